"""Student's t quantiles, for the paired intervals (``session.Paired``): any confidence, any degrees of
freedom, so a sequential comparison can spend its error over its looks (no table, no scipy)."""

from __future__ import annotations

import functools
import math

CONTINUED_FRACTION_TERMS = 300
TOLERANCE = 1e-14


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz),
    on the side of 0.5 where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, CONTINUED_FRACTION_TERMS):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < TOLERANCE:
            break
    return front * f


def cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / (df + t * t), df / 2, 0.5)
    return 1.0 - tail if t > 0 else tail


@functools.cache  # a run asks for a handful of (p, df), many times
def quantile(p: float, df: float) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` degrees of freedom, by bisection."""
    if not 0.5 < p < 1.0 or df <= 0:
        raise ValueError(f"a t quantile needs 0.5 < p < 1 and df > 0, not p={p}, df={df}")
    low, high = 0.0, 1.0
    while cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle, df) < p else (low, middle)
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2
