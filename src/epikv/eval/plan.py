"""What one evaluation run owes: the selected problems, this shard's share, what is already done.

Owns the (example, sample) work items, their order and batching, and the :class:`RunPlan` of one
config: the task sliced by ``--offset``/``--limit`` (an empty selection is an error, never an
``n 0`` table), the run folder, a saved config checked against the new one, and the items this
shard still owes. Planning reads and never writes, so checks can run on every plan before any work
(``runner.py`` runs them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epikv.eval.config import EvalConfig, check_compatible, parse_shard, resolve, run_dir, saved_form
from epikv.eval.records import load_run_results, load_skipped
from epikv.eval.tasks import Example, Task, load_task


@dataclass(frozen=True)
class WorkItem:
    example: Example
    sample: int


def plan_work(
    task: Task, n_samples: int, shard: tuple[int, int], done: set[tuple[str, int]]
) -> list[WorkItem]:
    """The (example, sample) pairs this shard owes, sample-major so a partial run covers every problem.

    Shard I of N takes the examples at positions p (within the sliced task) with p % N == I.
    """
    index, count = shard
    return [
        WorkItem(example, sample)
        for sample in range(n_samples)
        for position, example in enumerate(task)
        if position % count == index and (example.id, sample) not in done
    ]


def batches(items: Sequence[WorkItem], batch_size: int) -> Iterator[list[WorkItem]]:
    """Consecutive groups of at most `batch_size` items; a group never mixes sample indices,
    because each sample index is generated under its own seed."""
    group: list[WorkItem] = []
    for item in items:
        if group and (len(group) == batch_size or group[0].sample != item.sample):
            yield group
            group = []
        group.append(item)
    if group:
        yield group


def done_keys(folder: Path) -> set[tuple[str, int]]:
    """(id, sample) pairs with a result or a skip record in any file of the folder."""
    if not folder.is_dir():
        return set()
    return {r.key for r in load_run_results(folder)} | {r.key for r in load_skipped(folder)}


@dataclass
class RunPlan:
    """One config resolved against its task, and the (example, sample) pairs this shard owes.
    Planning writes nothing: a plan that is never run leaves no trace. ``dataset_size``: problems in
    the whole dataset, before ``--offset``/``--limit``."""

    config: EvalConfig
    task: Task
    dataset_size: int
    folder: Path
    shard: tuple[int, int]
    work: list[WorkItem]

    @property
    def label(self) -> str:
        return f"{self.config.policy} {self.config.budget_label}"

    @property
    def owed_examples(self) -> list[Example]:
        return list({item.example.id: item.example for item in self.work}.values())

    @property
    def selected_keys(self) -> set[tuple[str, int]]:
        """Every (id, sample) of the selection, all shards together: what summary.json counts."""
        return {(example.id, sample) for example in self.task for sample in range(self.config.n_samples)}

    def selection(self) -> dict[str, Any]:
        """What was selected, as recorded in summary.json."""
        first = self.config.offset  # positions in the task's order (a shuffled task too)
        return {
            "dataset_size": self.dataset_size,
            "problems": len(self.task),
            "positions": [first, first + len(self.task) - 1],
            "samples": self.config.n_samples,
            "shard": f"{self.shard[0]}/{self.shard[1]}",
        }


def plan_run(config: EvalConfig) -> RunPlan:
    """Loads and slices the task, checks a saved config.json against ``config`` and lists the work
    left, without creating anything. A selection without a problem is an error."""
    whole = load_task(config.dataset)
    task = whole.slice(config.offset, config.limit)
    if not len(task):
        if not len(whole):
            raise ValueError(f"dataset {config.dataset!r} has no problems")
        raise ValueError(
            f"--offset {config.offset} selects no problems: {whole.name} has {len(whole)} "
            f"(positions 0-{len(whole) - 1})"
        )
    config = resolve(config, task.max_new_tokens)
    folder = run_dir(config, task.name)
    config_path = folder / "config.json"
    if config_path.is_file():
        check_compatible(json.loads(config_path.read_text(encoding="utf-8")), saved_form(config), folder)
    shard = parse_shard(config.shard)
    work = plan_work(task, config.n_samples, shard, done_keys(folder))
    return RunPlan(config, task, len(whole), folder, shard, work)


def describe_selection(plans: Sequence[RunPlan]) -> str:
    """One line: which problems the eval selected and what each run still owes."""
    first = plans[0]
    low, high = first.selection()["positions"]
    shard = "" if first.shard[1] == 1 else f", shard {first.shard[0]}/{first.shard[1]}"
    owed = ", ".join(f"{plan.label} {len(plan.work)}" for plan in plans)
    return (
        f"selected: {first.task.name} problems {low}-{high} ({len(first.task)} of {first.dataset_size}) "
        f"x {first.config.n_samples} sample(s){shard}; to generate: {owed}"
    )
