"""Counts over problems: a Wilson interval for a rate and the exact McNemar test for two policies
run on the same problems.

The exact McNemar test comes from scipy (``binomtest``: the two-sided binomial test of the discordant
pairs at p = 1/2); the Wilson interval is the eval's own (:func:`epikv.eval.metrics.wilson_interval`,
tested against scipy's ``proportion_ci``), one formula for the whole project. Pure functions of
booleans per problem; nothing here runs a model or knows a policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from epikv.eval.metrics import wilson_interval


def _binomtest(successes: int, trials: int, p: float = 0.5) -> Any:  # scipy's BinomTestResult
    try:
        from scipy.stats import binomtest
    except ModuleNotFoundError as err:
        raise ImportError("the loop study's statistics need scipy: pip install 'epikv[eval]'") from err
    return binomtest(successes, trials, p)


class Rate(NamedTuple):
    """``successes`` of ``n`` with its rate and a two-sided Wilson interval [low, high]."""

    successes: int
    n: int
    rate: float
    low: float
    high: float


def wilson(successes: int, n: int, level: float = 0.95) -> Rate | None:
    """The rate ``successes / n`` with its Wilson score interval (no continuity correction); None
    when ``n`` is 0 (nothing to estimate)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return None
    from scipy.stats import norm

    low, high = wilson_interval(successes, n, float(norm.ppf((1 + level) / 2)))
    return Rate(successes, n, successes / n, low, high)


class McNemar(NamedTuple):
    """A against B on the same n problems: ``a_only`` problems where only A has the property,
    ``b_only`` where only B has it, the difference of rates (A - B) and the exact two-sided p."""

    n: int
    a_only: int
    b_only: int
    difference: float
    p_value: float


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """Exact McNemar test of paired booleans (entry i of both is problem i): under the null the
    discordant pairs split 1/2 : 1/2, so p is the two-sided binomial test of ``a_only`` of
    ``a_only + b_only`` (1.0 when no pair is discordant)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same problems: {len(a)} and {len(b)}")
    if not a:
        raise ValueError("no paired problems to compare")
    a_only = sum(bool(x) and not bool(y) for x, y in zip(a, b, strict=True))
    b_only = sum(bool(y) and not bool(x) for x, y in zip(a, b, strict=True))
    discordant = a_only + b_only
    p_value = float(_binomtest(a_only, discordant).pvalue) if discordant else 1.0
    return McNemar(len(a), a_only, b_only, (a_only - b_only) / len(a), min(1.0, p_value))
