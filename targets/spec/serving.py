"""A serving pool's production work (ROSE-like targets): the model it serves, its traffic and the
SLOs that traffic is held to. Rollout may borrow the pool's devices while their traffic allows; the
harness serves the traffic on the devices not lent and measures every request against the SLOs
(``docs/targets.md``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from targets.spec.base import Strict
from targets.spec.model import ModelSpec


class SloSpec(Strict):
    """What the serving traffic is promised: 99th-percentile time to the first token and time per
    output token, over the run."""

    ttft_p99_ms: float = Field(gt=0)
    tpot_p99_ms: float = Field(gt=0)


class ServingSpec(Strict):
    """The serving pool's model, its requests' shape, their arrival rate and their SLOs.

    ``rate`` is a rate curve or a binned recorded trace: ``[seconds, requests/s]`` points, the rate
    holding from each point to the next, the whole curve repeating every ``period_s``. Arrivals are
    Poisson at the rate of the moment."""

    model: ModelSpec
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=1)
    rate: tuple[tuple[float, float], ...] = Field(min_length=1)
    period_s: float = Field(gt=0)
    slo: SloSpec

    @model_validator(mode="after")
    def _rate_is_a_curve(self) -> ServingSpec:
        times = [t for t, _ in self.rate]
        if times[0] != 0:
            raise ValueError(f"rate: the curve starts at 0 s, not {times[0]}")
        for i, ((t0, _), (t1, _)) in enumerate(zip(self.rate, self.rate[1:], strict=False)):
            if t1 <= t0:
                raise ValueError(f"rate.{i + 1}: {t1} s does not come after {t0} s")
        if times[-1] >= self.period_s:
            raise ValueError(f"rate: the point at {times[-1]} s is not within period_s ({self.period_s} s)")
        negative = [(i, r) for i, (_, r) in enumerate(self.rate) if r < 0]
        if negative:
            raise ValueError(f"rate.{negative[0][0]}: a rate of {negative[0][1]} requests/s is negative")
        if not any(r > 0 for _, r in self.rate):  # no arrival would ever be drawn: the traffic waits forever
            raise ValueError("rate: every point is 0 requests/s: a serving pool with no traffic serves nothing")
        return self

    def rate_at(self, t: float) -> tuple[float, float]:
        """(requests/s at ``t``, seconds until the rate next changes)."""
        phase = t % self.period_s
        for (start, rps), (end, _) in zip(self.rate, [*self.rate[1:], (self.period_s, 0.0)], strict=True):
            if start <= phase < end:
                return rps, end - phase
        return self.rate[-1][1], self.period_s - phase  # phase rounding to period_s itself

    @property
    def peak_rps(self) -> float:
        return max(r for _, r in self.rate)
