"""The loop study's statistics and per-generation logic, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from epikv.bench.loops.summary import (
    cell_row,
    facts,
    left_before_eviction,
    loop_timing,
    markdown,
    paired_row,
    problem_facts,
    shifted_cells,
    summarize_loops,
)
from epikv.bench.shared import paired
from epikv.bench.shared.ci_plots import Ranked, rank, short
from epikv.eval.loops import LoopConfig

Z = 1.959963984540054  # the 97.5% normal quantile


def test_wilson_matches_the_formula_by_hand():
    got = paired.wilson(8, 10)
    # centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    p, n = 0.8, 10
    centre = (p + Z**2 / (2 * n)) / (1 + Z**2 / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z**2 / (4 * n * n)) / (1 + Z**2 / n)
    assert got.rate == 0.8 and got.low == pytest.approx(centre - half, abs=1e-9)
    assert got.high == pytest.approx(centre + half, abs=1e-9)
    assert (round(got.low, 4), round(got.high, 4)) == (0.4902, 0.9433)  # published tables
    zero = paired.wilson(0, 10)
    assert zero.low == pytest.approx(0, abs=1e-12) and zero.high == pytest.approx(Z**2 / (10 + Z**2))
    assert paired.wilson(0, 0) is None
    with pytest.raises(ValueError, match="0 <= successes <= n, got 11 of 10"):
        paired.wilson(11, 10)


def test_exact_mcnemar_is_the_binomial_test_of_discordant_pairs():
    # 1 problem only A loops, 7 only B, 2 both, 2 neither: p = 2 * P(X <= 1 | 8, 1/2) = 2 * 9/256
    a = [True] + [False] * 7 + [True, True, False, False]
    b = [False] + [True] * 7 + [True, True, False, False]
    test = paired.mcnemar_exact(a, b)
    assert (test.n, test.a_only, test.b_only) == (12, 1, 7)
    assert test.p_value == pytest.approx(18 / 256) and test.difference == pytest.approx(-6 / 12)
    assert paired.mcnemar_exact([False] * 5, [True] * 5).p_value == pytest.approx(2 / 32)
    assert paired.mcnemar_exact([True, False], [True, False]).p_value == 1.0  # nothing discordant
    with pytest.raises(ValueError, match="same problems: 2 and 1"):
        paired.mcnemar_exact([True, False], [True])


def test_loop_timing():
    assert loop_timing(40, None) == ("no eviction", None)
    assert loop_timing(40, 10) == ("after", 30)
    assert loop_timing(40, 40) == ("after", 0)  # the loop's first token came from an evicted cache
    assert loop_timing(5, 10) == ("before", -5)


LOOPS = LoopConfig(min_span=16, min_repeats=3, max_period=8)
PREFIX = list(range(100, 120))  # 20 distinct tokens, then a period-3 loop to the cap
LOOPING = PREFIX + [1, 2, 3] * 10


def _generation(tokens, first_evicted, correct=False, finish="length", **extra):
    record = {"token_ids": tokens, "finish_reason": finish, "correct": correct}
    return (
        record
        | {"first_evicted_index": first_evicted, "peak_cache_tokens": 8, "mean_cache_tokens": 7.0}
        | extra
    )


def test_facts_find_where_a_loop_starts_against_the_first_eviction():
    full = _generation(PREFIX + list(range(200, 230)), None, correct=True, finish="eos")
    after = facts(_generation(LOOPING, 12), full, LOOPS)
    assert after["loop"] and after["loop_onset"] == 20 and after["loop_period"] == 3
    assert after["timing"] == ("after", 8) and after["bound"] and after["cap_hit"]
    assert after["divergence"] == 20 and after["diverged"] and after["full_correct"] is True
    before = facts(_generation(LOOPING, 25), full, LOOPS)
    assert before["timing"] == ("before", -5)
    never = facts(_generation(LOOPING, None), full, LOOPS)
    assert never["timing"] == ("no eviction", None) and not never["bound"]
    same = facts(full, full, LOOPS)
    assert not same["loop"] and not same["diverged"] and same["divergence"] == 50  # kept to its end
    assert facts({"skipped": "too long"}, full, LOOPS) == {"skipped": "too long"}


def _problem(i, cells):
    return problem_facts({"dataset": "d", "id": str(i), "cells": cells}, LOOPS)


def test_cell_row_and_paired_tests_count_problems():
    right = _generation(PREFIX + list(range(200, 230)), None, correct=True, finish="eos")
    wrong = _generation(PREFIX + list(range(300, 330)), None, finish="eos")
    problems = [
        _problem(0, {"full": right, "h2o@8": _generation(LOOPING, 12), "tova@8": right}),
        _problem(1, {"full": right, "h2o@8": _generation(LOOPING, 30), "tova@8": right}),
        _problem(2, {"full": wrong, "h2o@8": wrong, "tova@8": {"skipped": "prompt too long"}}),
    ]
    row = cell_row(problems, "h2o@8")
    assert row["problems"] == 3 and row["skipped"] == 0
    assert row["loop"]["successes"] == 2 and row["cap_hit"]["successes"] == 2
    assert row["correct"]["successes"] == 0 and row["correct_finished"]["n"] == 1
    assert row["lost_vs_full"] == {"problems": 2, "looped": 2, "cap_hit": 2}
    assert row["loop_start"]["before"] == 1 and row["loop_start"]["after"] == 1
    assert row["loop_start"]["lag_after"] == [8.0, 8.0, 8.0]
    assert row["diverged"]["successes"] == 2 and row["bound"]["successes"] == 2
    assert row["loop"]["low"] == pytest.approx(paired.wilson(2, 3).low, abs=1e-5)
    tova = cell_row(problems, "tova@8")
    assert tova["problems"] == 2 and tova["skipped"] == 1
    test = paired_row(problems, "h2o@8", "tova@8")
    assert test["problems"] == 2  # the problem tova skipped is left out of the pairs
    assert (test["loop"]["a_only"], test["loop"]["b_only"]) == (2, 0) and test["loop"]["p_value"] == 0.5


def test_rank_puts_the_best_first_and_empty_rows_last():
    rows = [Ranked("a", 0.2, 0.1, 0.3), Ranked("b", None, None, None), Ranked("c", 0.5, 0.4, 0.6)]
    assert [r.label for r in rank(rows, higher_is_better=True)] == ["c", "a", "b"]
    assert [r.label for r in rank(rows, higher_is_better=False)] == ["a", "c", "b"]
    assert short("epikv") == "epikv" and short("epikv:interval=32") == "epikv\ninterval=32"


def test_facts_and_rows_report_both_loop_detectors():
    # Lines whose two-digit number changes every time: a loop only to the near-periodic detector,
    # told that tokens 50-59 are the digits 0-9.
    counting = PREFIX + [t for n in range(10, 17) for t in (50 + n // 10, 50 + n % 10, 200, 201)]
    full = _generation(PREFIX + list(range(300, 328)), None, finish="eos")
    digits = frozenset(range(50, 60))
    near = facts(_generation(counting, 12), full, LOOPS, digits)
    assert not near["loop"] and near["near_loop"] and near["near_loop_onset"] == 20
    assert not facts(_generation(counting, 12), full, LOOPS)["near_loop"]  # no number tokens: exact
    both = facts(_generation(LOOPING, 12), full, LOOPS, digits)
    assert both["loop"] and both["near_loop"] and both["near_loop_onset"] == both["loop_onset"]
    problems = [
        problem_facts({"dataset": "d", "id": str(i), "cells": cells}, LOOPS, digits)
        for i, cells in enumerate(
            [
                {"full": full, "h2o@8": _generation(counting, 12)},
                {"full": full, "h2o@8": _generation(LOOPING, 12)},
                {"full": full, "h2o@8": full},
            ]
        )
    ]
    row = cell_row(problems, "h2o@8")
    assert row["loop"]["successes"] == 1 and row["near_loop"]["successes"] == 2
    assert row["detectors"] == {"both": 1, "exact_only": 0, "near_only": 1}
    test = paired_row(problems, "h2o@8", "full")
    assert (test["near_loop"]["a_only"], test["near_loop"]["b_only"]) == (2, 0)
    assert (test["loop"]["a_only"], test["loop"]["b_only"]) == (1, 0)


def test_a_tiny_exact_p_is_kept_not_rounded_to_zero():
    full = _generation(PREFIX + list(range(300, 328)), None, finish="eos")
    problems = [_problem(i, {"full": full, "h2o@8": _generation(LOOPING, 12)}) for i in range(20)]
    p = paired_row(problems, "h2o@8", "full")["loop"]["p_value"]
    assert p == pytest.approx(2 * 0.5**20, rel=1e-2) and p > 0


def test_left_before_eviction_is_a_departure_from_full_while_the_cache_was_complete():
    full = _generation(PREFIX + list(range(200, 230)), None, finish="eos")
    # LOOPING leaves full's trace at token 20 (the loop's first token).
    assert left_before_eviction(facts(_generation(LOOPING, 25), full, LOOPS))  # left at 20, evicted at 25
    assert not left_before_eviction(facts(_generation(LOOPING, 12), full, LOOPS))  # evicted first
    assert not left_before_eviction(facts(_generation(LOOPING, 20), full, LOOPS))  # token 20: evicted cache
    assert left_before_eviction(facts(_generation(LOOPING, None), full, LOOPS))  # never evicted, left
    assert not left_before_eviction(facts(_generation(full["token_ids"], 5), full, LOOPS))  # never left
    assert not left_before_eviction(facts(_generation(LOOPING, 25), None, LOOPS))  # no full to leave


def test_a_cell_is_flagged_shifted_over_half_and_the_table_says_so():
    full = _generation(PREFIX + list(range(200, 230)), None, finish="eos")
    early, late = _generation(LOOPING, 25), _generation(LOOPING, 12)  # left at 20: before / after
    plan = [
        {"label": "full", "kind": "peak", "target": 9, "budget": None, "cell": "full"},
        {"label": "h2o", "kind": "peak", "target": 9, "budget": 8, "cell": "h2o@8"},
        {"label": "tova", "kind": "peak", "target": 9, "budget": 8, "cell": "tova@8"},
    ]
    # h2o: 2 of 4 left before any eviction (half: not over the limit); tova: 3 of 4 (75%).
    h2o = [early, late, early, full]
    tova = [early, early, late, {"skipped": "too long"}, early]
    problems = [
        _problem(
            i,
            {"full": full, "h2o@8": h2o[i], "tova@8": tova[i]}
            if i < 4
            else {"full": full, "tova@8": tova[i]},
        )
        for i in range(5)
    ]
    summary = summarize_loops(problems, plan, ["full"])
    rows = summary["rows"]["d"]
    assert rows["h2o@8"]["left_before_eviction"]["successes"] == 2
    assert rows["h2o@8"]["left_before_eviction"]["n"] == 4 and not rows["h2o@8"]["shifted"]
    assert rows["tova@8"]["left_before_eviction"]["successes"] == 3
    assert rows["tova@8"]["left_before_eviction"]["n"] == 4 and rows["tova@8"]["shifted"]  # skip left out
    assert not rows["full"]["shifted"] and shifted_cells(summary) == {"tova@8": 0.75}
    table = markdown(summary)
    assert "3/4 [30, 95]% **shifted**" in table and "2/4 [15, 85]% |" in table
    assert "**Shifted** (tova)" in table and "**Shifted** (h2o" not in table
