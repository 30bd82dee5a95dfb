"""``epikv bench frontier status|run|summarize``: the frontier study (issue 56, ``frontier.py``).

``status`` lists every cell with its home, what its folder holds, what it owes and the minutes that
would take at the speed its engine has shown in either study (the CPU those speeds came from is
printed: they are estimates for that CPU, not for this one); ``run`` computes new cells one at a
time (named, or the next N that owe work), resuming each, and never a reused cell; ``summarize``
recomputes every number from the records (``summary.json`` in the frontier's folder), with the
cells the declared extension rule sends on to 512 problems. Nothing here runs two cells at once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from epikv.bench.accuracy.design import EMULATED_BF16_HELP
from epikv.bench.accuracy.frontier import HOME, Frontier, FrontierCell


def add_frontier_parser(kinds: Any) -> None:
    parser = kinds.add_parser("frontier", help="accuracy, memory and speed at equal peak memory (issue 56)")
    actions = parser.add_subparsers(dest="frontier_action", required=True, metavar="ACTION")
    status = actions.add_parser("status", help="every cell: home, done, owed, estimated minutes")
    run = actions.add_parser("run", help="compute new cells one at a time (resumes each)")
    run.add_argument("--cell", action="append", default=[], help="a cell by name (repeatable)")
    run.add_argument("--next", type=int, default=0, help="the next N new cells that owe work, in order")
    run.add_argument("--limit", type=int, default=None, help="only the first N problems (whole batches)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--emulated-bf16", action="store_true", help=EMULATED_BF16_HELP)
    summarize = actions.add_parser("summarize", help="recompute the frontier's numbers from the records")
    for action in (status, run, summarize):
        action.add_argument("--out", default=HOME["frontier"], help="the new cells' folder")
        action.add_argument("--study", default=HOME["accuracy"], help="the accuracy study's folder")
    status.set_defaults(func=cmd_status)
    run.set_defaults(func=cmd_run)
    summarize.set_defaults(func=cmd_summarize)


def folder(cell: FrontierCell, args: argparse.Namespace) -> str:
    return args.out if cell.home == "frontier" else args.study


def statuses(frontier: Frontier, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each frontier cell's status (``cells.cell_status``) with its level and home, then the
    accuracy study's cells' (whose speeds estimate the new cells')."""
    from epikv.bench.accuracy.cells import cell_status

    study = frontier.study
    mine = [
        {**cell_status(study, c.cell, folder(c, args)), "level": c.level, "home": c.home}
        for c in frontier.cells()
    ]
    return mine + [cell_status(study, c, args.study) for c in study.cells() if not c.tag]


def cmd_status(args: argparse.Namespace) -> int:
    from epikv.bench.accuracy.cells import bf16_refused, estimate_minutes

    frontier = Frontier()
    found = statuses(frontier, args)
    total, unknown = 0.0, 0
    for status in (s for s in found if "level" in s):
        minutes = estimate_minutes(status, found)
        total += minutes or 0.0
        unknown += minutes is None and status["owed"] > 0
        shown = "?" if minutes is None else f"{minutes:.0f} min"
        print(
            f"peak {status['level']:3} {status['cell']:34} {status['home']:8} {status['engine']:14} "
            f"done {status['done']:4}/{status['problems']:<4} owed {status['owed']:4}  ~{shown}"
        )
    print(
        f"owed in all: ~{total / 60:.1f} h at the speeds measured so far ({unknown} cells with no speed: ?)"
    )
    print(f"speeds measured on: {', '.join(sorted(_cpus(args)))}")
    if bf16_refused(frontier.study):
        print("this CPU has no bf16 matrix units: `run` refuses here (--emulated-bf16 runs anyway)")
    return 0


def _cpus(args: argparse.Namespace) -> set[str]:
    out = set()
    for home in (args.out, args.study):
        log = Path(home) / "runs.jsonl"
        for line in log.read_text().splitlines() if log.is_file() else []:
            cpu = json.loads(line).get("cpu") or {}
            if cpu.get("model"):
                out.add(f"{cpu['model']} ({', '.join(cpu.get('flags') or [])})")
    return out or {"nothing yet"}


def cmd_run(args: argparse.Namespace) -> int:
    from epikv.bench.accuracy.cells import cell_status, run_cell

    frontier = Frontier()
    cells = [frontier.find(name) for name in args.cell]
    for cell in cells:
        if cell.home != "frontier":
            raise ValueError(
                f"{cell.name} is the accuracy study's cell: run it with `epikv bench accuracy run`"
            )
    if args.next:
        new = [c for c in frontier.cells() if c.home == "frontier" and c not in cells]
        owing = [c for c in new if cell_status(frontier.study, c.cell, args.out)["owed"]]
        cells += owing[: args.next]
    if not cells:
        raise ValueError("nothing to run: name cells with --cell, or ask for --next N")
    for cell in cells:
        print(f"cell {cell.name} (peak {cell.level}) on {cell.cell.engine}", flush=True)
        outcome = run_cell(
            frontier.study, cell.cell, args.out, not args.no_progress, args.limit, args.emulated_bf16
        )
        accuracy = outcome.summary.get("accuracy")
        print(f"  generated {outcome.generated}, skipped {outcome.skipped}, accuracy {accuracy}", flush=True)
    return 0


def summarize(frontier: Frontier, args: argparse.Namespace) -> dict[str, Any]:
    """Per level: the accuracy study's :func:`~epikv.bench.accuracy.summary.level` over the level's
    cells that hold records (against ``full``), each cell's speed and mean length from its records,
    and the new cells the declared rule extends."""
    from epikv.bench.accuracy.summary import CellData, level, number_ids
    from epikv.eval.loops import LoopConfig

    study = frontier.study
    numbers, loops = number_ids(args.study, study.model), LoopConfig(min_span=study.loop_min_span)
    full = CellData(study, frontier.full(), args.study, numbers, loops)
    rows = {s["cell"]: s for s in statuses(frontier, args) if "level" in s}
    out: dict[str, Any] = {"problems": frontier.problems, "extended": frontier.extended, "levels": {}}
    for peak in frontier.levels:
        cells = [c for c in frontier.cells() if c.level == peak]
        data = [CellData(study, c.cell, folder(c, args), numbers, loops) for c in cells]
        data = [d for d in data if d.records]
        found = level(data, full) if data and full.records else {"n": 0, "cells": []}
        found["costs"] = {
            c.name: {k: rows[c.name][k] for k in ("tokens_per_s", "mean_tokens", "done")} for c in cells
        }
        found["target_pairs"] = frontier.target_pairs(peak)
        found["extend"] = frontier.to_extend(peak, found.get("pairs", {}).get("tests", []))
        out["levels"][str(peak)] = found
    return out


def cmd_summarize(args: argparse.Namespace) -> int:
    result = summarize(Frontier(), args)
    path = Path(args.out) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(path)
    return 0
