"""Means with 95% Student-t intervals over seeds, without scipy: the t quantile by bisection on its CDF, the CDF
by Simpson's rule on the density."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["mean_interval", "t_quantile"]


def _t_pdf(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf_above_zero(x: float, df: int, n: int = 2000) -> float:
    """P(0 < T < x) by Simpson's rule (n even)."""
    h = x / n
    s = _t_pdf(0, df) + _t_pdf(x, df) + sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, n))
    return s * h / 3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom, by bisection on its CDF."""
    lo, hi = 0.0, 1.0
    while 0.5 + _t_cdf_above_zero(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 + _t_cdf_above_zero(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: list[float], bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """Mean and its 95% t-interval over seeds (no interval from one seed), cut to ``bounds`` when given: an
    accuracy's interval over three seeds can reach past 0 or 1, which no accuracy can."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "lo": None, "hi": None, "n": n, "values": values}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    lo, hi = mean - half, mean + half
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return {"mean": mean, "lo": lo, "hi": hi, "n": n, "values": values}
