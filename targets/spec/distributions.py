"""Distributions a spec draws from: turn counts, environment latency."""

from __future__ import annotations

import math
import random
from typing import Annotated, Literal

from pydantic import Field, field_validator

from targets.spec.base import Strict


class Fixed(Strict):
    kind: Literal["fixed"]
    value: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.value

    def mean_value(self) -> float:
        return self.value


class Geometric(Strict):
    """Number of trials until first success, support 1, 2, ...; long tail for small success rates."""

    kind: Literal["geometric"]
    mean: float = Field(ge=1, le=1e6)  # past 1e6, 1 - 1/mean rounds toward 1 and a draw divides by log(1) = 0

    def sample(self, rng: random.Random) -> float:
        p = 1.0 / self.mean
        if p >= 1.0:
            return 1.0
        return float(1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)))

    def mean_value(self) -> float:
        return self.mean


class Lognormal(Strict):
    """Heavy-tailed positive values: median ``median``, log-space spread ``sigma``."""

    kind: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0, le=10)  # a spread of e^10 per standard deviation already spans any tail measured

    def sample(self, rng: random.Random) -> float:
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    def mean_value(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)


class Empirical(Strict):
    """The values a run measured, each as likely: a shape no two-parameter family holds (turn counts of an
    environment whose episodes end at 2 turns or at 40 lost the second peak to a lognormal, 2.4x the work)."""

    kind: Literal["empirical"]
    values: list[float] = Field(min_length=1, max_length=100_000)

    @field_validator("values")
    @classmethod
    def _non_negative(cls, values: list[float]) -> list[float]:
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError("every value must be a finite number >= 0")
        return values

    def sample(self, rng: random.Random) -> float:
        return self.values[min(len(self.values) - 1, int(rng.random() * len(self.values)))]

    def mean_value(self) -> float:
        return math.fsum(self.values) / len(self.values)


Distribution = Annotated[Fixed | Geometric | Lognormal | Empirical, Field(discriminator="kind")]
