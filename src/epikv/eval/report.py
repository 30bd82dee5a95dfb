"""The markdown comparison table of finished runs, and the entry point that also draws the figures.

Owns the table's columns and formatting. The runs come from `runs.py` (files only, never a live
run), the figures from `plots.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epikv.eval.plots import draw_all
from epikv.eval.runs import RunSummary, find_run_folders, load_run, load_runs

__all__ = ["RunSummary", "find_run_folders", "format_table", "load_run", "load_runs", "report"]


def _sort_key(run: RunSummary) -> tuple[str, str, float]:
    return run.dataset, run.policy, float("inf") if run.budget is None else float(run.budget)


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def format_table(runs: Sequence[RunSummary]) -> str:
    """Markdown table, one row per run: accuracy with its Wilson 95% interval (percent), rates, costs."""
    columns = ["dataset", "policy", "budget", "n", "accuracy % [95% CI]", "cap-hit %", "loop %"]
    columns += ["mean tokens", "peak / mean cached", "s/problem"]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in sorted(runs, key=_sort_key):
        s = run.summary
        low, high = s["accuracy_ci95"]
        accuracy = f"{_percent(s['accuracy'])} [{_percent(low)}, {_percent(high)}]"
        skipped = s.get("n_skipped") or 0  # prompts that could not run: never counted as wrong
        n = f"{s['n']} (+{skipped} skipped)" if skipped else str(s["n"])
        rows.append(
            f"| {run.dataset} | {run.policy} | {run.budget_label} | {n} | {accuracy} "
            f"| {_percent(s['cap_hit_rate'])} | {_percent(s['loop_rate'])} "
            f"| {_number(s['mean_tokens'], 0)} | {_cached(s)} | {_number(s['seconds_per_problem'], 2)} |"
        )
    return "\n".join(rows)


def _cached(summary: dict[str, Any]) -> str:
    """Peak and mean cached tokens per sequence (the memory a policy really used; older summaries
    may lack either)."""
    peak, mean = summary.get("mean_peak_cache_tokens"), summary.get("mean_cache_tokens")
    return f"{_number(peak, 0)} / {_number(mean, 0)}"


def report(dirs: Sequence[str | Path], plots: str | Path | None = None, regrade_text: bool = False) -> str:
    """Markdown table of every run folder under `dirs`; when `plots` is given, also writes the PNGs there
    (the CLI prints the table before drawing instead, see `cli.report_command`)."""
    runs = load_runs(dirs, regrade_text)
    table = format_table(runs)
    if plots is not None:
        draw_all(runs, Path(plots))
    return table
