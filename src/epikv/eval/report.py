"""Reading finished run folders back: per-run summaries and the markdown comparison table.

Owns discovery of run folders under the given paths and the table. Everything comes from the files
(`config.json`, `results*.jsonl`), never from a live run, so a table can be rebuilt at any time and
shards written by separate processes are merged here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from epikv.eval.metrics import summarize
from epikv.eval.records import RESULTS_GLOB, ExampleResult, load_run_results


@dataclass(frozen=True)
class RunSummary:
    folder: Path
    dataset: str
    policy: str
    budget: int | None
    summary: dict[str, Any]

    @property
    def budget_label(self) -> str:
        return "full" if self.budget is None else str(self.budget)


def _is_run_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob(RESULTS_GLOB))


def find_run_folders(paths: Iterable[str | Path]) -> list[Path]:
    """Run folders at or below each path (a folder with config.json and a results file)."""
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise FileNotFoundError(f"not a folder: {path}")
        candidates = [path, *(c.parent for c in path.rglob("config.json"))]
        found.update(c.resolve() for c in candidates if _is_run_folder(c))
    return sorted(found)


def regrade(records: list[ExampleResult], dataset: str) -> list[ExampleResult]:
    """The records graded again from their stored text with the task's current rules."""
    from epikv.eval.tasks import load_task

    task = load_task(dataset)
    examples = {example.id: example for example in task}
    out = []
    for record in records:
        grade = task.evaluate(examples[record.id], record.text)
        out.append(replace(record, correct=grade.correct, extracted=grade.extracted))
    return out


def load_run(folder: Path, regrade_text: bool = False) -> RunSummary:
    """Summary of one run folder recomputed from its results files (all shards merged); with
    ``regrade_text`` the stored completions are graded again (after a grading rule changed)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    records = load_run_results(folder)
    if regrade_text:
        records = regrade(records, str(config["dataset"]))
    # The layout is OUT/<dataset>/<policy>/K<budget>/; the dataset label is the folder name,
    # which for a JSONL or hub dataset differs from the `dataset` spec in config.json.
    return RunSummary(
        folder=folder,
        dataset=folder.parent.parent.name,
        policy=str(config["policy"]),
        budget=config.get("budget"),
        summary=summarize(records),
    )


def _sort_key(run: RunSummary) -> tuple[str, str, float]:
    return run.dataset, run.policy, float("inf") if run.budget is None else float(run.budget)


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def format_table(runs: Sequence[RunSummary]) -> str:
    """Markdown table, one row per run: accuracy with its Wilson 95% interval (percent), rates, costs."""
    columns = ["dataset", "policy", "budget", "n", "accuracy % [95% CI]", "cap-hit %", "loop %"]
    columns += ["mean tokens", "s/problem"]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in sorted(runs, key=_sort_key):
        s = run.summary
        low, high = s["accuracy_ci95"]
        accuracy = f"{_percent(s['accuracy'])} [{_percent(low)}, {_percent(high)}]"
        rows.append(
            f"| {run.dataset} | {run.policy} | {run.budget_label} | {s['n']} | {accuracy} "
            f"| {_percent(s['cap_hit_rate'])} | {_percent(s['loop_rate'])} "
            f"| {_number(s['mean_tokens'], 0)} | {_number(s['seconds_per_problem'], 2)} |"
        )
    return "\n".join(rows)


def report(dirs: Sequence[str | Path], plots: str | Path | None = None, regrade_text: bool = False) -> str:
    """Markdown table of every run folder under `dirs`; when `plots` is given, also writes the PNGs there."""
    folders = find_run_folders(dirs)
    if not folders:
        raise FileNotFoundError(f"no run folders (config.json + results*.jsonl) under {list(map(str, dirs))}")
    runs = [load_run(folder, regrade_text) for folder in folders]
    if plots is not None:
        from epikv.eval.plots import draw_all

        draw_all(runs, Path(plots))
    return format_table(runs)
