"""Grading the study's stored generations again (issue 58): on hand-made run folders."""

from __future__ import annotations

import dataclasses
import json

from epikv.bench.accuracy.design import Arm, Study
from epikv.bench.accuracy.regrade import holm_flips, regrade_cell
from epikv.eval.plan import plan_run
from epikv.eval.records import append_result, load_run_results
from epikv.eval.runner import prepare_folder
from epikv.eval.tasks import load_task

from .test_accuracy import _record


def _study() -> Study:
    arm = Arm("gsm8k", "gsm8k:shuffle=0", 4, 64, (100,), ("full",))
    return dataclasses.replace(Study(arms=(arm,)), noise_problems=4, budget_problems=4)


def test_regrade_updates_the_verdicts_the_rules_move_and_names_why(tmp_path):
    study = _study()
    cell = study.find("gsm8k/full@full")
    plan = plan_run(cell.config(str(tmp_path), study.model, study.dtype, progress=False))
    prepare_folder(plan.folder, plan.config)
    golds = [(e.id, e.answer) for e in load_task("gsm8k:shuffle=0").slice(0, 4)]
    texts = [  # (text, cut at the cap, stored verdict): what the grader before issue 58 said
        (f"so 3 x 8 = {golds[0][1]}", True, True),  # cut, no marker: its last number is the gold
        (f"so \\boxed{{{golds[1][1]}}}.", False, True),  # a complete box: stays right
        (f"so \\boxed{{{golds[2][1]}}}, then \\boxed{{1", True, True),  # the last box cut open
        ("so \\boxed{0}.", False, False),  # wrong, stays wrong
    ]
    with (plan.folder / "results.jsonl").open("a") as handle:
        for (i, gold), (text, cut, correct) in zip(golds, texts, strict=True):
            record = dataclasses.replace(_record(i, correct, [1, 2], cap=cut), gold=gold, text=text)
            append_result(handle, dataclasses.replace(record, extracted=gold if correct else "0"))
    lines = (plan.folder / "results.jsonl").read_text().splitlines()

    row = regrade_cell(study, cell, str(tmp_path))
    assert (row["records"], row["updated"]) == (4, 2)
    assert [(m["id"], m["old"], m["new"]) for m in row["moved"]] == [
        (golds[0][0], True, False), (golds[2][0], True, False)
    ]  # fmt: skip
    assert "no final-answer marker" in row["moved"][0]["why"]
    assert "cut open" in row["moved"][1]["why"]
    after = (plan.folder / "results.jsonl").read_text().splitlines()
    assert (after[1], after[3]) == (lines[1], lines[3])  # lines not changed are kept byte for byte
    assert json.loads(after[0]) == json.loads(lines[0]) | {"correct": False, "extracted": None}
    assert [r.correct for r in load_run_results(plan.folder)] == [False, True, False, False]
    assert json.loads((plan.folder / "summary.json").read_text())["accuracy"] == 0.25
    again = regrade_cell(study, cell, str(tmp_path))
    assert (again["updated"], again["moved"]) == (0, [])


def test_holm_flips_lists_the_tests_whose_call_at_005_changed():
    def summary(p_pair: float, p_full: float) -> dict:
        return {"arms": {"gsm8k": {"levels": {"192": {
            "pairs": {"tests": [{"a": "x", "b": "y", "what": "correct", "p_holm": p_pair}]},
            "vs_full": {"tests": [{"a": "x", "b": "full", "what": "correct", "p_holm": p_full}]},
        }}}}}  # fmt: skip

    flips = holm_flips(summary(0.04, 0.5), summary(0.06, 0.4))
    assert [(f["test"], f["significant_before"], f["significant_after"]) for f in flips] == [
        ("arms/gsm8k/levels/192/pairs/tests: x vs y (correct)", True, False)
    ]
    assert holm_flips(summary(0.04, 0.5), summary(0.01, 0.9)) == []


def test_the_provenance_table_numbers_pieces_per_cell_and_keeps_unrecorded_facts_null(tmp_path):
    from epikv.bench.accuracy.provenance import table

    xeon = {"model": "Intel Xeon", "flags": ["avx2"]}
    lines = [
        {"cell": "a", "generated": 96, "kept": 64, "skipped": 0, "cpu": xeon, "code": None, "note": "cut"},
        {"cell": "b", "generated": 0, "skipped": 1, "cpu": None, "code": None, "note": "added"},
        {"cell": "a", "generated": 64, "skipped": 2, "cpu": {"model": "AMD EPYC"}, "code": "273c4c9"},
    ]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    found = table(tmp_path)
    rows = [(r["cell"], r["piece"], r["kept"], r["records_after"], r["code"], r["cpu"], r["annotated"])
            for r in found["pieces"]]  # fmt: skip
    assert rows == [
        ("a", 1, 64, 64, None, "Intel Xeon", True), ("b", 1, 0, 1, None, None, True),
        ("a", 2, 64, 130, "273c4c9", "AMD EPYC", False),
    ]  # fmt: skip
    assert found["cells"]["a"] == {"codes": [None, "273c4c9"], "cpus": ["Intel Xeon", "AMD EPYC"]}
