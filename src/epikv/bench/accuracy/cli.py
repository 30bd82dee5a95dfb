"""``epikv bench accuracy status|run|summarize|compare|regrade``: the accuracy study on a model that can do
the task.

``status`` lists every cell with what its folder holds, what it owes and the minutes that would take at
the speed its engine has shown; ``run`` computes cells one at a time (named, or the next N that owe
work), resuming each; ``summarize`` recomputes every number from the run folders and writes
``summary.json``, ``summary.md``, ``accuracy.png`` and ``provenance.json`` beside them; ``compare`` sets
cells run again into another folder (``run --out``, on another machine) against the study's; ``regrade``
grades the stored generations again after a grading rule changed (``regrade.py``). Nothing here runs two
cells at once: on two cores each would halve the other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from epikv.bench.accuracy.design import EMULATED_BF16_HELP

DEFAULT_OUT = "results/accuracy"


def add_accuracy_parser(kinds: Any) -> None:
    parser = kinds.add_parser("accuracy", help="accuracy under a budget on Qwen2.5-Coder-1.5B (issue 41)")
    actions = parser.add_subparsers(dest="accuracy_action", required=True, metavar="ACTION")
    status = actions.add_parser("status", help="every cell: done, owed, estimated minutes")
    run = actions.add_parser("run", help="compute cells one at a time (resumes each)")
    run.add_argument("--cell", action="append", default=[], help="a cell by name (repeatable)")
    run.add_argument("--next", type=int, default=0, help="the next N cells that owe work, in order")
    run.add_argument(
        "--limit", type=int, default=None, help="only the first N problems (whole batches), e.g. a pilot"
    )
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--emulated-bf16", action="store_true", help=EMULATED_BF16_HELP)
    summarize = actions.add_parser("summarize", help="recompute the study's numbers from its records")
    compare = actions.add_parser("compare", help="cells run again elsewhere against the study's records")
    compare.add_argument("--repeat", required=True, help="the folder the cells were run again into")
    regrade = actions.add_parser("regrade", help="grade the stored generations again by the current rules")
    for action in (status, run, summarize, compare, regrade):
        action.add_argument("--out", default=DEFAULT_OUT, help=f"the study's folder (default {DEFAULT_OUT})")
    status.set_defaults(func=cmd_status)
    run.set_defaults(func=cmd_run)
    summarize.set_defaults(func=cmd_summarize)
    compare.set_defaults(func=cmd_compare)
    regrade.set_defaults(func=cmd_regrade)


def cmd_status(args: argparse.Namespace) -> int:
    from epikv.bench.accuracy.cells import bf16_refused, cell_status, estimate_minutes
    from epikv.bench.accuracy.design import Study

    study = Study()
    statuses = [cell_status(study, cell, args.out) for cell in study.cells()]
    total = 0.0
    for status in statuses:
        minutes = estimate_minutes(status, statuses)
        total += minutes or 0.0
        shown = "?" if minutes is None else f"{minutes:.0f} min"
        print(
            f"{status['cell']:36} {status['engine']:14} done {status['done']:4}/{status['problems']:<4} "
            f"skipped {status['skipped']:3} owed {status['owed']:4}  ~{shown}"
        )
    print(f"owed in all: ~{total / 60:.1f} h at the speeds measured so far (cells marked ? not counted)")
    if bf16_refused(study):
        print("this CPU has no bf16 matrix units: `run` refuses here (--emulated-bf16 runs anyway)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from epikv.bench.accuracy.cells import cell_status, run_cell
    from epikv.bench.accuracy.design import Study

    study = Study()
    cells = [study.find(name) for name in args.cell]
    if args.next:
        owing = [c for c in study.cells() if c not in cells and cell_status(study, c, args.out)["owed"]]
        cells += owing[: args.next]
    if not cells:
        raise ValueError("nothing to run: name cells with --cell, or ask for --next N")
    for cell in cells:
        print(f"cell {cell.name} on {cell.engine}", flush=True)
        outcome = run_cell(
            study, cell, args.out, not args.no_progress, args.limit, emulated_bf16=args.emulated_bf16
        )
        accuracy = outcome.summary.get("accuracy")
        print(f"  generated {outcome.generated}, skipped {outcome.skipped}, accuracy {accuracy}", flush=True)
    return 0


def cmd_summarize(args: argparse.Namespace) -> int:
    from epikv.bench.accuracy.design import Study

    _write_summary(Study(), Path(args.out))
    return 0


def _write_summary(study: Any, out: Path) -> dict[str, Any]:
    """summary.json, summary.md and accuracy.png in ``out``, recomputed from its run folders, and
    provenance.json (which code and CPU made each piece) from its runs.jsonl."""
    from epikv.bench.accuracy.provenance import table
    from epikv.bench.accuracy.report import markdown, plot
    from epikv.bench.accuracy.summary import number_ids, summarize

    result = summarize(study, str(out), number_ids(str(out), study.model))
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    (out / "provenance.json").write_text(json.dumps(table(out), indent=1) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(markdown(result), encoding="utf-8")
    print(out / "summary.json")
    print(out / "summary.md")
    print(plot(result, study, out / "accuracy.png"))
    return result


def cmd_regrade(args: argparse.Namespace) -> int:
    """Every cell's records graded again; where any changed, ``regrade.json`` lists the verdicts that
    moved and (when the folder has a summary) the study's summary is re-made and the Holm calls that
    flipped are listed; a second run finds nothing to change and writes nothing."""
    from epikv.bench.accuracy.design import Study
    from epikv.bench.accuracy.regrade import holm_flips, regrade_cell
    from epikv.bench.shared.regrade import listing

    study, out = Study(), Path(args.out)
    rows = [regrade_cell(study, cell, args.out) for cell in study.cells()]
    updated = sum(r["updated"] for r in rows)
    print(f"{sum(r['records'] for r in rows)} records graded again, {updated} updated")
    if not updated:
        return 0
    result = listing(rows)
    summary = out / "summary.json"
    if summary.is_file():
        before = json.loads(summary.read_text(encoding="utf-8"))
        result["holm_flipped"] = holm_flips(before, _write_summary(study, out))
    (out / "regrade.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{len(result['moved'])} verdicts moved: {out / 'regrade.json'}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from epikv.bench.accuracy.design import Study
    from epikv.bench.accuracy.summary import number_ids, repeats

    study = Study()
    found = repeats(study, args.out, args.repeat, number_ids(args.out, study.model))
    if not found:
        raise ValueError(f"--repeat {args.repeat}: holds no records of the study's cells")
    runs = Path(args.repeat) / "runs.jsonl"
    logged = [json.loads(line) for line in runs.read_text().splitlines()] if runs.is_file() else []
    cpus = list({json.dumps(e.get("cpu"), sort_keys=True): e.get("cpu") for e in logged}.values())
    result = {"against": args.out, "repeat": args.repeat, "repeat_cpu": cpus, "cells": found}
    path = Path(args.repeat) / "compare.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for name, row in found.items():
        print(f"{name:36} n {row['n']:4}  verdict changed {row['changed']:3}  identical tokens "
              f"{row['identical_tokens']:4}")  # fmt: skip
    print(path)
    return 0
