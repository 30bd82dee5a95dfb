"""What the studies' re-grades share (issue 58): the rule that moved a verdict, the tests whose call
at 0.05 changed, and the listing of the verdicts that moved.

The grading itself is the eval's (a task's ``evaluate``, the cut taken from the record's finish
reason) and the records' layout each study's own (``accuracy/regrade.py``: run folders of text;
``loops/regrade.py``: parts of token ids). Nothing here reads or writes a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from epikv.eval.extract import box_cut_open
from epikv.eval.forms import asked_forms, in_forms

ALPHA = 0.05


def why(text: str, finish_reason: str | None, old: str | None, new: str | None, problem: str) -> str:
    """The rule that changed a generation's grade from the extracted answer ``old`` to ``new``
    (``text``: the generation, ``problem``: the problem it answers)."""
    if box_cut_open(text) and new is None:
        return "the last box is cut open: no earlier box or number stands in for it"
    if finish_reason == "length" and new is None:
        return "cut at the length cap with no final-answer marker: its last number is not credited"
    forms = asked_forms(problem)
    if forms and not in_forms(new, forms):
        return f"the problem asks for the form {'/'.join(sorted(forms))}; {new!r} is not in it"
    return f"extracted {old!r}, now {new!r}"


def flips(before: dict[str, float], after: dict[str, float], name: str = "p") -> list[dict[str, Any]]:
    """The tests (key -> p, under ``name``) whose significance at :data:`ALPHA` differs between two
    summaries; a test in only one of them is not a flip."""
    return [
        {"test": key, f"{name}_before": before[key], f"{name}_after": after[key],
         "significant_before": before[key] < ALPHA, "significant_after": after[key] < ALPHA}
        for key in sorted(before.keys() & after.keys()) if (before[key] < ALPHA) != (after[key] < ALPHA)
    ]  # fmt: skip


def listing(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The head of a ``regrade.json`` from per-cell rows (``cell``, ``records``, ``updated``,
    ``moved``): the records graded, those updated, the moved verdicts per cell and each of them."""
    return {
        "records": sum(r["records"] for r in rows),
        "updated": sum(r["updated"] for r in rows),
        "moved_per_cell": {r["cell"]: len(r["moved"]) for r in rows if r["moved"]},
        "moved": [m for r in rows for m in r["moved"]],
    }
