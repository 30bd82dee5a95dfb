"""The study's stored generations graded again by the grader's current rules (issue 58).

Every record of every cell (the noise cells too) is graded from its stored text and finish reason
by the eval's own path (:func:`epikv.eval.runs.regrade`, the task's ``evaluate``); where the verdict
or the extracted answer changed the record is updated in place and the cell's ``summary.json``
re-made as its run would make it. Nothing is generated. Owns the list of verdicts that moved and
the Holm calls (significance at 0.05) that changed between two ``summary.json``; the rule that
moved each verdict and the flip test are shared with the loop study's re-grade
(``bench/shared/regrade.py``), the grading rules are the eval's, the statistics ``summary.py``'s.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from epikv.bench.accuracy.design import Cell, Study
from epikv.bench.shared.regrade import flips, why
from epikv.eval.plan import plan_run
from epikv.eval.records import load_run_results, update_results
from epikv.eval.runner import summarize_selection
from epikv.eval.runs import regrade
from epikv.eval.tasks import load_task


def regrade_cell(study: Study, cell: Cell, out: str) -> dict[str, Any]:
    """Grades ``cell``'s records in ``out`` again; updates those that changed. Returns the cell's
    records, the records updated, and the verdicts that moved."""
    plan = plan_run(cell.config(out, study.model, study.dtype, progress=False))
    records = load_run_results(plan.folder) if plan.folder.is_dir() else []
    if not records:
        return {"cell": cell.name, "records": 0, "updated": 0, "moved": []}
    now = regrade(records, cell.dataset)
    examples = {e.id: e for e in load_task(cell.dataset)}
    pairs = zip(records, now, strict=True)
    changed = [(r, n) for r, n in pairs if (r.correct, r.extracted) != (n.correct, n.extracted)]
    moved = [
        {"cell": cell.name, "id": r.id, "old": r.correct, "new": n.correct,
         "why": why(r.text, r.finish_reason, r.extracted, n.extracted, examples[r.id].problem),
         "extracted": [r.extracted, n.extracted], "finish_reason": r.finish_reason}
        for r, n in changed if r.correct != n.correct
    ]  # fmt: skip
    verdicts = {n.key: {"correct": n.correct, "extracted": n.extracted} for _, n in changed}
    updated = update_results(plan.folder, verdicts)
    if updated:  # the run's own summary, on the selection its last piece ran (its saved --limit)
        saved = json.loads((plan.folder / "config.json").read_text(encoding="utf-8"))
        last = plan_run(dataclasses.replace(plan.config, limit=saved.get("limit", plan.config.limit)))
        summary = summarize_selection(last)
        (plan.folder / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return {"cell": cell.name, "records": len(records), "updated": updated, "moved": moved}


def _holm_calls(node: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every Holm-adjusted test in a ``summary.json`` dict: (where it is and which pair, p (Holm))."""
    if isinstance(node, dict):
        if "p_holm" in node:
            yield f"{path}: {node['a']} vs {node['b']} ({node['what']})", node["p_holm"]
        for key, value in node.items():
            yield from _holm_calls(value, f"{path}/{key}" if path else key)
    elif isinstance(node, list):
        for value in node:
            yield from _holm_calls(value, path)


def holm_flips(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The Holm calls whose significance at 0.05 differs between two summaries (a test in only one
    of them is not a flip)."""
    return flips(dict(_holm_calls(before)), dict(_holm_calls(after)), "p_holm")
