"""Distributions a spec draws from: turn counts, environment latency."""

from __future__ import annotations

import math
import random
from typing import Annotated, Literal

from pydantic import Field

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


Distribution = Annotated[Fixed | Geometric | Lognormal, Field(discriminator="kind")]
