"""Reading finished run folders back: one summary per run, recomputed from its files.

Owns discovery of run folders under the given paths, the `RunSummary` of each and regrading stored
completions. Everything comes from the files (`config.json`, `results*.jsonl`, `skipped*.jsonl`),
never from a live run, so summaries can be rebuilt at any time and shards written by separate
processes are merged here. The table (`report.py`) and the figures (`plots.py`) both read these summaries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from epikv.eval.metrics import summarize
from epikv.eval.records import RESULTS_GLOB, SKIPPED_GLOB, ExampleResult, load_run_results, load_skipped
from epikv.eval.tasks import load_task
from epikv.policies import policy_class


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
    """config.json and at least one record: a run that failed before its first record is no run."""
    records = [*folder.glob(RESULTS_GLOB), *folder.glob(SKIPPED_GLOB)]
    return (folder / "config.json").is_file() and any(path.stat().st_size for path in records)


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
    task = load_task(dataset)
    examples = {example.id: example for example in task}
    out = []
    for record in records:
        grade = task.evaluate(examples[record.id], record.text, cut=record.finish_reason == "length")
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
    policy = str(config["policy"])
    return RunSummary(
        folder=folder,
        dataset=folder.parent.parent.name,
        policy=policy,
        budget=config.get("budget") if _evicts(policy) else None,
        summary=summarize(records, load_skipped(folder)),
    )


def _evicts(policy: str) -> bool:
    """Whether a policy name evicts. Older versions filed `--policy full --budget 160` under K160:
    a budget that meant nothing, read here as none (so `full` is a reference line, not a point)."""
    try:
        return policy_class(policy).evicts
    except ValueError:  # a policy this version does not know: trust its saved budget
        return True


def load_runs(dirs: Sequence[str | Path], regrade_text: bool = False) -> list[RunSummary]:
    """Summaries of every run folder under `dirs`; an error when there is none."""
    folders = find_run_folders(dirs)
    if not folders:
        raise FileNotFoundError(f"no run folders (config.json + results*.jsonl) under {list(map(str, dirs))}")
    return [load_run(folder, regrade_text) for folder in folders]
