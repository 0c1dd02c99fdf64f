"""Distributions a spec draws from: turn counts, environment latency."""

from __future__ import annotations

import bisect
import itertools
import math
import random
from typing import Annotated, Literal

from pydantic import Field, model_validator

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
    """The values a run measured, each seen ``counts`` times (once each where none are given): a shape no
    two-parameter family holds (turn counts of an environment whose episodes end at 2 turns or at 40 lost the
    second peak to a lognormal, 2.4x the work)."""

    kind: Literal["empirical"]
    values: list[float] = Field(min_length=1, max_length=100_000)
    counts: list[int] | None = None

    @model_validator(mode="after")
    def _valid(self) -> Empirical:
        if not all(math.isfinite(v) and v >= 0 for v in self.values):
            raise ValueError("every value must be a finite number >= 0")
        if self.counts is not None and (len(self.counts) != len(self.values) or min(self.counts) < 1):
            raise ValueError(f"counts: one whole number >= 1 for each of the {len(self.values)} values")
        return self

    def _cumulative(self) -> list[int]:
        return list(itertools.accumulate(self.counts or [1] * len(self.values)))

    def sample(self, rng: random.Random) -> float:
        cumulative = self._cumulative()
        return self.values[bisect.bisect_right(cumulative, int(rng.random() * cumulative[-1]))]

    def mean_value(self) -> float:
        counts = self.counts or [1] * len(self.values)
        return math.fsum(v * n for v, n in zip(self.values, counts)) / sum(counts)


Distribution = Annotated[Fixed | Geometric | Lognormal | Empirical, Field(discriminator="kind")]
