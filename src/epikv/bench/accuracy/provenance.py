"""Which code and which CPU made each piece of the study's records, from ``runs.jsonl`` alone.

``run`` appends a line per piece of compute (a cell run, or resumed, to some ``--limit``); lines added
or corrected by hand after the fact say so in a ``note`` (or ``repaired``: ``annotated`` in the table),
and a fact nobody recorded stays null. Owns the table the results page quotes: per piece, the cell, its
records (generated, and kept where some were removed afterwards), its skips, the records the cell held
after it, the commit it ran at and the CPU it ran on. It reads no run folder and computes no statistic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RUNS = "runs.jsonl"


def read_runs(out: str | Path) -> list[dict[str, Any]]:
    """The lines of ``out/runs.jsonl`` (none when the study has not run)."""
    path = Path(out) / RUNS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def pieces(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per line of ``runs.jsonl``, in its order, numbered within its cell."""
    held: dict[str, int] = {}
    rows = []
    for entry in runs:
        cell = entry["cell"]
        kept = entry["generated"] if entry.get("kept") is None else entry["kept"]
        held[cell] = held.get(cell, 0) + kept + entry["skipped"]
        cpu = entry.get("cpu") or {}
        rows.append({
            "cell": cell, "piece": sum(r["cell"] == cell for r in rows) + 1, "generated": entry["generated"],
            "kept": kept, "skipped": entry["skipped"], "records_after": held[cell], "code": entry.get("code"),
            "cpu": cpu.get("model"), "cpu_flags": cpu.get("flags"), "ended": entry.get("ended"),
            "annotated": bool(entry.get("note") or entry.get("repaired")),
        })  # fmt: skip
    return rows


def table(out: str | Path) -> dict[str, Any]:
    """``provenance.json``: the pieces, and per cell the commits and CPUs its pieces name."""
    rows = pieces(read_runs(out))
    cells: dict[str, dict[str, list[Any]]] = {}
    for row in rows:
        seen = cells.setdefault(row["cell"], {"codes": [], "cpus": []})
        for key, value in (("codes", row["code"]), ("cpus", row["cpu"])):
            if value not in seen[key]:
                seen[key].append(value)
    return {"source": RUNS, "pieces": rows, "cells": cells}
