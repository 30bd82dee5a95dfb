"""The schedule question of the loop study as a 2x2 (issue 33): two schedules (K, tau) crossed with
two scorers, four cells of loops documents, on the problems all four ran.

Per problem each cell has a boolean (a loop, say); every effect is a per-problem contrast of them:
the main effect of the rows (the mean over the columns of row 1 - row 0), of the columns, their
interaction ((r1c1 - r1c0) - (r0c1 - r0c0)), and the four simple effects. Each contrast gets its mean
in points with a percentile bootstrap interval over problems (:func:`epikv.bench.shared.stats.
bootstrap_mean`) and a sign test: the exact two-sided binomial test of the problems where it is
positive against those where it is negative (:func:`epikv.bench.shared.paired.mcnemar_exact` of
"positive" against "negative"; for a simple effect that is the exact McNemar test). Also here: how
far two cells' first evictions differ on the problems both ran, and paired tests of any other pairs.
Pure functions of documents' ``problems`` (see :mod:`epikv.bench.loops.summary`); nothing runs a
model. ``python -m epikv.bench.loops.factorial`` writes them as JSON and markdown.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from epikv.bench.loops.summary import _quartiles, _round, cell_facts, paired_row
from epikv.bench.shared import documents, paired, stats


def merge_problems(documents_problems: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Problems of several loops documents of the same study (same problems, other cells) as one
    list: per (dataset, id), the union of their cells; the first document's order."""
    merged: dict[str, dict[str, Any]] = {}
    for problems in documents_problems:
        for p in problems:
            key = f"{p['dataset']}/{p['id']}"
            into = merged.setdefault(key, {**p, "cells": {}})
            for cell, found in p["cells"].items():
                into["cells"].setdefault(cell, found)
    return list(merged.values())


def _effect(values: np.ndarray) -> dict[str, Any]:
    """Mean of a per-problem contrast in points, its bootstrap interval, and the sign test."""
    ci = stats.bootstrap_mean(values)
    test = paired.mcnemar_exact(list(values > 0), list(values < 0))
    return {
        "points": round(100 * ci.mean, 2),
        "ci": [round(100 * ci.low, 2), round(100 * ci.high, 2)],
        "positive": test.a_only,
        "negative": test.b_only,
        "p_value": _round(test.p_value),
    }


def two_by_two(
    problems: list[dict[str, Any]],
    cells: Sequence[Sequence[str]],
    rows: Sequence[str],
    columns: Sequence[str],
    prop: str = "loop",
) -> dict[str, Any]:
    """``cells[r][c]`` is the cell at row level r and column level c (two of each). Every effect is
    level 1 minus level 0 of its factor, on the problems all four cells ran (skips left out)."""
    found = [[cell_facts(problems, cell) for cell in row] for row in cells]
    keys = [k for k in found[0][0] if all(k in f for row in found for f in row)]
    if not keys:
        raise ValueError(f"no problem was run by all four cells {cells}")
    y = [[np.array([float(f[k][prop]) for k in keys]) for f in row] for row in found]
    (r0c0, r0c1), (r1c0, r1c1) = y
    contrasts = {
        f"{rows[1]} - {rows[0]} (main)": (r1c0 + r1c1 - r0c0 - r0c1) / 2,
        f"{columns[1]} - {columns[0]} (main)": (r0c1 + r1c1 - r0c0 - r1c0) / 2,
        "interaction": (r1c1 - r1c0) - (r0c1 - r0c0),
        f"{columns[1]} - {columns[0]} at {rows[0]}": r0c1 - r0c0,
        f"{columns[1]} - {columns[0]} at {rows[1]}": r1c1 - r1c0,
        f"{rows[1]} - {rows[0]} at {columns[0]}": r1c0 - r0c0,
        f"{rows[1]} - {rows[0]} at {columns[1]}": r1c1 - r0c1,
        f"{rows[1]}, {columns[1]} - {rows[0]}, {columns[0]}": r1c1 - r0c0,
    }
    return {
        "prop": prop,
        "problems": len(keys),
        "cells": [list(row) for row in cells],
        "rows": list(rows),
        "columns": list(columns),
        "counts": [[int(v.sum()) for v in row] for row in y],
        "effects": {name: _effect(values) for name, values in contrasts.items()},
    }


def first_eviction_gap(problems: list[dict[str, Any]], cell: str, other: str) -> dict[str, Any]:
    """On the problems both cells ran: how many evicted in neither, only one, or both; where both
    did, how often ``cell``'s first eviction (a generated-token index) comes later, earlier or at
    the same token as ``other``'s, and the quartiles of the difference (cell - other)."""
    mine, theirs = cell_facts(problems, cell), cell_facts(problems, other)
    both = [k for k in mine if k in theirs]
    pairs = [(mine[k]["first_evicted"], theirs[k]["first_evicted"]) for k in both]
    bound = [(a, b) for a, b in pairs if a is not None and b is not None]
    gaps = [a - b for a, b in bound]
    return {
        "cell": cell,
        "other": other,
        "problems": len(both),
        "neither_evicted": sum(a is None and b is None for a, b in pairs),
        "only_cell_evicted": sum(a is not None and b is None for a, b in pairs),
        "only_other_evicted": sum(a is None and b is not None for a, b in pairs),
        "both_evicted": len(bound),
        "cell_later": sum(g > 0 for g in gaps),
        "cell_earlier": sum(g < 0 for g in gaps),
        "same": sum(g == 0 for g in gaps),
        "gap_quartiles": _quartiles(gaps),
    }


def markdown(found: dict[str, Any]) -> str:
    """The 2x2s (one per detector): counts and effects; the first-eviction gaps and the pairs."""
    lines = []
    for design in found["two_by_two"].values():
        lines += [f"{design['prop']} on the {design['problems']} problems all four cells ran:", ""]
        lines += ["| | " + " | ".join(design["columns"]) + " |", "|---|---|---|"]
        for level, cells, counts in zip(design["rows"], design["cells"], design["counts"], strict=True):
            named = " | ".join(f"{c}: {n}" for c, n in zip(cells, counts, strict=True))
            lines.append(f"| {level} | {named} |")
        lines += ["", "| effect | points [95% bootstrap] | positive / negative | sign test p |"]
        lines.append("|---|---|---|---|")
        for name, e in design["effects"].items():
            lines.append(
                f"| {name} | {e['points']:+.2f} [{e['ci'][0]:+.2f}, {e['ci'][1]:+.2f}] | "
                f"{e['positive']} / {e['negative']} | {e['p_value']:.2g} |"
            )
        lines.append("")
    header = "| first eviction: cell vs other | problems | neither / only cell / only other / both "
    lines += [
        header + "| cell later / earlier / same | cell - other, quartiles |",
        "|---|---|---|---|---|",
    ]
    for g in found["first_eviction"]:
        lines.append(
            f"| {g['cell']} vs {g['other']} | {g['problems']} | {g['neither_evicted']} / "
            f"{g['only_cell_evicted']} / {g['only_other_evicted']} / {g['both_evicted']} | "
            f"{g['cell_later']} / {g['cell_earlier']} / {g['same']} | {g['gap_quartiles']} |"
        )
    lines += ["", "| cell vs reference | problems | cell / reference | only cell / only reference | p |"]
    lines.append("|---|---|---|---|---|")
    for row in found["pairs"]:
        for prop in ("loop", "near_loop"):
            t = row[prop]
            a, b = t["a_only"], t["b_only"]
            both = row["both"][prop]
            lines.append(
                f"| {row['cell']} vs {row['reference']} ({prop}) | {t['n']} | {both + a} / {both + b} | "
                f"{a} / {b} | {t['p_value']:.2g} |"
            )
    return "\n".join(lines) + "\n"


def _pair(problems: list[dict[str, Any]], cell: str, reference: str) -> dict[str, Any]:
    """:func:`paired_row` plus the problems on which both have each property (to give counts)."""
    row = paired_row(problems, cell, reference)
    mine, theirs = cell_facts(problems, cell), cell_facts(problems, reference)
    keys = [k for k in mine if k in theirs]
    row["cell"] = cell
    row["both"] = {p: sum(mine[k][p] and theirs[k][p] for k in keys) for p in ("loop", "near_loop")}
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epikv.bench.loops.factorial", description=__doc__)
    parser.add_argument("results", nargs="+", help="loops.json documents of the same problems")
    parser.add_argument("--cells", required=True, help="r0c0,r0c1,r1c0,r1c1: the four cells")
    parser.add_argument("--rows", default="tau=1,tau=128", help="the row levels' names")
    parser.add_argument("--columns", default="h2o,Seg-Q", help="the column levels' names")
    parser.add_argument("--gap", nargs=2, action="append", default=[], metavar=("CELL", "OTHER"))
    parser.add_argument("--pair", nargs=2, action="append", default=[], metavar=("CELL", "REFERENCE"))
    parser.add_argument("--out", required=True, help="the JSON to write (markdown beside it, .md)")
    args = parser.parse_args(argv)
    problems = merge_problems(
        [documents.read_result(r, "loops")["results"]["problems"] for r in args.results]
    )
    c = args.cells.split(",")
    if len(c) != 4:
        raise ValueError(f"--cells needs four cells, got {args.cells!r}")
    found = {
        "results": args.results,
        "two_by_two": {
            prop: two_by_two(problems, [c[:2], c[2:]], args.rows.split(","), args.columns.split(","), prop)
            for prop in ("loop", "near_loop")
        },
        "first_eviction": [first_eviction_gap(problems, cell, other) for cell, other in args.gap],
        "pairs": [_pair(problems, cell, reference) for cell, reference in args.pair],
    }
    out = Path(args.out)
    out.write_text(json.dumps(found, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
