"""Run-level metrics over per-example records.

Owns the Wilson interval, the metric table (each metric says its name, whether higher is better and
how it aggregates, as lm-eval does) and `summarize`. Pure functions of `ExampleResult`s; no files.

With n samples per problem, accuracy is pass@1 as the mean over all samples; the Wilson interval
then treats samples as independent trials, which understates the width when samples correlate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from epikv.eval.records import ExampleResult, SkippedExample

Z_95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when n == 0.

    The bounds always hold the observed rate ``successes / n`` (exactly 0 for none, 1 for all)."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denominator = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    # The interval contains p in exact arithmetic, but at p = 0 (or 1) centre and half are equal up to
    # rounding, which left the bound ~1e-17 on the wrong side of p: a negative error bar (issue #12).
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _accuracy_finished(records: Sequence[ExampleResult]) -> float | None:
    return _mean([float(r.correct) for r in records if not r.cap_hit])


def _seconds_per_problem(records: Sequence[ExampleResult]) -> float | None:
    problems = {r.id for r in records}
    return sum(r.seconds for r in records) / len(problems) if problems else None


def _tokens_per_second(records: Sequence[ExampleResult]) -> float | None:
    seconds = sum(r.seconds for r in records)
    return sum(r.tokens_generated for r in records) / seconds if seconds > 0 else None


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool | None  # None: descriptive (cost), neither direction is "better" per se
    aggregation: str
    description: str
    compute: Callable[[Sequence[ExampleResult]], float | None]


def _fraction(attribute: str) -> Callable[[Sequence[ExampleResult]], float | None]:
    return lambda records: _mean([float(getattr(r, attribute)) for r in records])


def _average(attribute: str) -> Callable[[Sequence[ExampleResult]], float | None]:
    return lambda records: _mean([getattr(r, attribute) for r in records])


def _average_known(attribute: str) -> Callable[[Sequence[ExampleResult]], float | None]:
    """The mean over records that have the value (older records may not)."""
    return lambda records: _mean([v for r in records if (v := getattr(r, attribute)) is not None])


METRICS: tuple[Metric, ...] = (
    Metric("accuracy", True, "mean", "fraction correct (pass@1 over samples)", _fraction("correct")),
    Metric("cap_hit_rate", False, "mean", "fraction stopped by the length cap", _fraction("cap_hit")),
    Metric("loop_rate", False, "mean", "fraction ending in a repetition loop", _fraction("loop")),
    Metric("accuracy_finished", True, "mean", "accuracy of generations ended by EOS", _accuracy_finished),
    Metric("mean_tokens", None, "mean", "generated tokens per sequence", _average("tokens_generated")),
    Metric("mean_peak_cache_tokens", False, "mean", "peak cached tokens", _average("peak_cache_tokens")),
    Metric("mean_cache_tokens", False, "mean", "cached tokens per step", _average_known("mean_cache_tokens")),
    Metric("seconds_per_problem", False, "sum / problems", "wall seconds per problem", _seconds_per_problem),
    Metric("tokens_per_second", True, "sum / sum", "generated tokens per wall second", _tokens_per_second),
)


def summarize(records: Sequence[ExampleResult], skipped: Sequence[SkippedExample] = ()) -> dict[str, Any]:
    """The summary.json object: counts, every metric's value, the accuracy CI and metric descriptions.
    Skipped examples (prompts that could not run) are counted apart and enter no metric."""
    correct = sum(r.correct for r in records)
    low, high = wilson_interval(correct, len(records))
    summary: dict[str, Any] = {
        "n": len(records),
        "n_problems": len({r.id for r in records}),
        "n_correct": correct,
        "n_skipped": len(skipped),
    }
    for metric in METRICS:
        summary[metric.name] = metric.compute(records)
    summary["accuracy_ci95"] = [low, high]
    summary["metrics"] = {
        m.name: {
            "higher_is_better": m.higher_is_better,
            "aggregation": m.aggregation,
            "description": m.description,
        }
        for m in METRICS
    }
    return summary
