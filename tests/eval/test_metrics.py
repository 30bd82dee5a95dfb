from __future__ import annotations

import dataclasses

import pytest
from scipy.stats import binomtest

from epikv.eval.metrics import METRICS, summarize, wilson_interval
from epikv.eval.records import ExampleResult


def record(
    example_id: str, correct: bool, *, tokens: int = 100, cap_hit: bool = False, loop: bool = False,
    seconds: float = 1.0, sample: int = 0, mean_cache: float | None = None,
) -> ExampleResult:  # fmt: skip
    return ExampleResult(
        id=example_id, sample=sample, correct=correct, extracted="1", gold="1", tokens_generated=tokens,
        prompt_tokens=5, finish_reason="length" if cap_hit else "eos", cap_hit=cap_hit, loop=loop,
        loop_onset=0 if loop else None, loop_period=1 if loop else None, seconds=seconds,
        call_seconds=seconds, batch_size=1, peak_cache_tokens=tokens, final_cache_tokens=tokens,
        evictions=0, text="", mean_cache_tokens=mean_cache,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [
        # Reference values: the roots π of (k/n − π)² = z²·π(1 − π)/n, solved by bisection by hand,
        # independently of the closed form in wilson_interval.
        (7, 10, 0.39678, 0.89221),
        (0, 10, 0.0, 0.27753),
        (10, 10, 0.72247, 1.0),
        (50, 100, 0.40383, 0.59617),
    ],
)
def test_wilson_interval_against_hand_values(successes: int, n: int, low: float, high: float) -> None:
    got_low, got_high = wilson_interval(successes, n)
    assert got_low == pytest.approx(low, abs=1e-5)
    assert got_high == pytest.approx(high, abs=1e-5)


def test_wilson_interval_equals_scipys_wilson() -> None:
    # The closed form stays here (scipy's binomtest computes a p-value first: 1 ms a call); scipy is
    # the reference it must match.
    for n in (1, 2, 3, 7, 10, 31, 100):
        for successes in range(n + 1):
            found = binomtest(successes, n).proportion_ci(0.95, method="wilson")
            assert wilson_interval(successes, n) == pytest.approx((found.low, found.high), abs=1e-12)


def test_wilson_interval_contains_the_observed_rate() -> None:
    # Issue #12: the closed form put the bound of 0 of n a few 1e-17 above 0 (and of n of n just below
    # 1), so `epikv report --plots` drew a negative error bar and crashed.
    for n in range(1, 301):
        for successes in range(n + 1):
            low, high = wilson_interval(successes, n)
            assert 0.0 <= low <= successes / n <= high <= 1.0, (successes, n, low, high)
    assert wilson_interval(0, 50)[0] == 0.0
    assert wilson_interval(10, 10)[1] == 1.0


def test_wilson_interval_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="successes=11"):
        wilson_interval(11, 10)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_summary_arithmetic() -> None:
    records = [
        record("a", True, tokens=100, seconds=2.0),
        record("b", False, tokens=300, cap_hit=True, loop=True, seconds=6.0),
        record("c", True, tokens=200, seconds=4.0),
        record("d", False, tokens=400, cap_hit=True, seconds=8.0),
    ]
    summary = summarize(records)
    assert summary["n"] == 4 and summary["n_correct"] == 2
    assert summary["accuracy"] == 0.5
    assert summary["cap_hit_rate"] == 0.5
    assert summary["loop_rate"] == 0.25
    assert summary["accuracy_finished"] == 1.0
    assert summary["mean_tokens"] == 250
    assert summary["seconds_per_problem"] == 5.0
    assert summary["tokens_per_second"] == 1000 / 20
    assert summary["accuracy_ci95"] == list(wilson_interval(2, 4))


def test_pass_at_1_over_samples_and_seconds_per_problem() -> None:
    records = [record("a", s < 3, sample=s, seconds=1.0) for s in range(4)]
    records += [record("b", s < 1, sample=s, seconds=1.0) for s in range(4)]
    summary = summarize(records)
    assert summary["accuracy"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert summary["n_problems"] == 2
    assert summary["seconds_per_problem"] == 4.0


def test_empty_run_has_no_values() -> None:
    summary = summarize([])
    assert summary["n"] == 0 and summary["accuracy"] is None and summary["tokens_per_second"] is None


def test_metrics_describe_themselves() -> None:
    described = summarize([record("a", True)])["metrics"]
    assert set(described) == {m.name for m in METRICS}
    assert described["accuracy"]["higher_is_better"] is True
    assert described["cap_hit_rate"]["higher_is_better"] is False
    assert all(dataclasses.is_dataclass(m) for m in METRICS)
