"""The loop study's 2x2 (schedule x scores), first-eviction gaps and pairs, against hand-computed values."""

from __future__ import annotations

import json

import pytest

from epikv.bench.loops.factorial import first_eviction_gap, main, merge_problems, two_by_two
from epikv.bench.loops.study import LoopsConfig
from epikv.bench.loops.summary import problem_facts
from epikv.bench.shared import documents
from epikv.eval.loops import LoopConfig

LOOPS = LoopConfig(min_span=16, min_repeats=3, max_period=8)
PREFIX = list(range(100, 120))
LOOPING = PREFIX + [1, 2, 3] * 10
PLAIN = PREFIX + list(range(200, 230))
CELLS = [["a", "b"], ["c", "d"]]  # rows r0, r1; columns c0, c1


def _gen(loops: bool, first_evicted: int | None = 5) -> dict:
    return {
        "token_ids": LOOPING if loops else PLAIN,
        "finish_reason": "length" if loops else "eos",
        "correct": False,
        "first_evicted_index": first_evicted,
    }


def _problems(table: list[tuple[int | None, ...]]) -> list[dict]:
    """One problem per row of (a, b, c, d) loop flags; None: that cell skipped the problem."""
    out = []
    for i, flags in enumerate(table):
        cells = {"full": _gen(False, None)}
        for name, flag in zip("abcd", flags, strict=True):
            cells[name] = {"skipped": "too long"} if flag is None else _gen(bool(flag))
        out.append(problem_facts({"dataset": "d", "id": str(i), "cells": cells}, LOOPS))
    return out


def test_two_by_two_contrasts_by_hand():
    problems = _problems(
        [(1, 1, 0, 0), (1, 0, 1, 0), (0, 0, 0, 1), (1, 1, 1, 1), (0, 1, 0, 0), (1, 1, 1, None)]
    )
    found = two_by_two(problems, CELLS, ["r0", "r1"], ["c0", "c1"])
    assert found["problems"] == 5  # the problem d skipped is left out of all four
    assert found["counts"] == [[3, 3], [2, 2]]
    e = found["effects"]
    # per problem: rows (c + d - a - b)/2 = -1, 0, .5, 0, -.5; columns (b + d - a - c)/2 = 0, -1, .5, 0, .5
    assert e["r1 - r0 (main)"]["points"] == -20.0
    assert (e["r1 - r0 (main)"]["positive"], e["r1 - r0 (main)"]["negative"]) == (1, 2)
    assert e["c1 - c0 (main)"]["points"] == 0.0
    assert (e["c1 - c0 (main)"]["positive"], e["c1 - c0 (main)"]["negative"]) == (2, 1)
    # interaction (d - c) - (b - a) = 0, 0, 1, 0, -1
    assert e["interaction"]["points"] == 0.0 and e["interaction"]["p_value"] == 1.0
    assert e["r1 - r0 at c1"]["points"] == -20.0  # d - b = -1, 0, 1, 0, -1
    assert e["r1 - r0 at c0"]["points"] == -20.0 and e["r1 - r0 at c0"]["negative"] == 1  # c - a
    assert e["r1, c1 - r0, c0"]["points"] == -20.0  # d - a = -1, -1, 1, 0, 0


def test_a_lone_effect_gets_its_exact_sign_test_and_a_degenerate_interval():
    found = two_by_two(_problems([(0, 0, 0, 1)] * 6), CELLS, ["r0", "r1"], ["c0", "c1"])
    rows, inter = found["effects"]["r1 - r0 (main)"], found["effects"]["interaction"]
    assert rows["points"] == 50.0 and rows["ci"] == [50.0, 50.0]  # every problem +1/2
    assert rows["p_value"] == pytest.approx(2 / 64)  # 6 of 6 positive: 2 * (1/2)^6
    assert inter["points"] == 100.0 and (inter["positive"], inter["negative"]) == (6, 0)
    with pytest.raises(ValueError, match="no problem was run by all four"):
        two_by_two(_problems([(0, 0, 0, None)]), CELLS, ["r0", "r1"], ["c0", "c1"])


def test_first_eviction_gap_counts_later_earlier_and_one_sided_evictions():
    problems = []
    for i, (mine, theirs) in enumerate([(10, 4), (None, 8), (30, 30), (5, None), (None, None), (3, 9)]):
        cells = {"full": _gen(False, None), "x": _gen(False, mine), "y": _gen(False, theirs)}
        problems.append(problem_facts({"dataset": "d", "id": str(i), "cells": cells}, LOOPS))
    gap = first_eviction_gap(problems, "x", "y")
    assert gap["problems"] == 6 and gap["neither_evicted"] == 1 and gap["both_evicted"] == 3
    assert (gap["only_cell_evicted"], gap["only_other_evicted"]) == (1, 1)
    assert (gap["cell_later"], gap["cell_earlier"], gap["same"]) == (1, 1, 1)
    assert gap["gap_quartiles"] == [-3.0, 0.0, 3.0]  # gaps 6, 0, -6


def test_main_merges_documents_and_writes_json_and_markdown(tmp_path):
    problems = _problems([(1, 1, 0, 0), (1, 0, 1, 0), (0, 0, 0, 1), (1, 1, 1, 1)])
    first = [
        {**p, "cells": {k: v for k, v in p["cells"].items() if k in ("full", "a", "b")}} for p in problems
    ]
    second = [
        {**p, "cells": {k: v for k, v in p["cells"].items() if k in ("full", "c", "d")}} for p in problems
    ]
    assert merge_problems([first, second])[2]["cells"].keys() == problems[2]["cells"].keys()
    paths = []
    for i, part in enumerate((first, second)):
        doc = documents.make_document("loops", LoopsConfig(), {"problems": part}, "cpu", [])
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "fact.json"
    main([*map(str, paths), "--cells", "a,b,c,d", "--gap", "a", "c", "--pair", "d", "a", "--out", str(out)])
    found = json.loads(out.read_text())
    assert found["two_by_two"]["loop"]["counts"] == [[3, 2], [2, 2]]
    assert found["two_by_two"]["near_loop"]["counts"] == [[3, 2], [2, 2]]  # no numbers: the same loops
    assert found["pairs"][0]["loop"]["a_only"] == 1 and found["pairs"][0]["both"]["loop"] == 1
    table = out.with_suffix(".md").read_text()
    assert "| d vs a (loop) | 4 | 2 / 3 | 1 / 2 | 1 |" in table
    assert (
        "near_loop on the 4 problems all four cells ran:" in table and "| interaction | +25.00" in table
    )  # (d - c) - (b - a): 0, 0, 1, 0
