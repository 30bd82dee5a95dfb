"""Running one evaluation config: plan, check, generate in batches, grade, record, summarise.

Owns the run folder's life cycle: a plan that writes nothing (config check, resume vs. mismatch, the
(example, sample) pairs this shard still owes), the check of every owed prompt before any generation
(``fit.py``), batched calls to the generator, appending each graded record as it finishes, and
recording the problems that were skipped. It never grades by itself (the task does) and never knows
the model or policy beyond the names it passes to the generator factory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm.auto import tqdm

from epikv.eval.config import (
    ConfigMismatchError,
    EvalConfig,
    check_compatible,
    parse_shard,
    resolve,
    run_dir,
    saved_form,
)
from epikv.eval.fit import FitReport, Unfit, check_fit, unfit_error
from epikv.eval.loops import LoopConfig, detect_loop
from epikv.eval.metrics import summarize
from epikv.eval.prompts import build_messages
from epikv.eval.protocol import Generator, GeneratorFactory, SequenceResultLike, make_sampling
from epikv.eval.records import (
    ExampleResult,
    SkippedExample,
    append_result,
    load_run_results,
    load_skipped,
    repair_tail,
    results_filename,
)
from epikv.eval.tasks import Example, Task, load_task


class RunFolderBusyError(OSError):
    """Another process holds the lock of this run folder's results file (a concurrent eval)."""


@dataclass(frozen=True)
class WorkItem:
    example: Example
    sample: int


@dataclass(frozen=True)
class RunOutcome:
    folder: Path
    config: EvalConfig
    generated: int
    summary: dict[str, Any]
    skipped: int = 0


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


def make_record(
    task: Task, item: WorkItem, result: SequenceResultLike, batch_size: int, loop_config: LoopConfig
) -> ExampleResult:
    grade = task.evaluate(item.example, result.text)
    loop = detect_loop(result.token_ids, loop_config)
    return ExampleResult(
        id=item.example.id,
        sample=item.sample,
        correct=grade.correct,
        extracted=grade.extracted,
        gold=item.example.answer,
        tokens_generated=result.tokens_generated,
        prompt_tokens=result.prompt_tokens,
        finish_reason=result.finish_reason,
        cap_hit=result.finish_reason == "length",
        loop=loop is not None,
        loop_onset=None if loop is None else loop.onset,
        loop_period=None if loop is None else loop.period,
        seconds=result.seconds / batch_size,
        call_seconds=result.seconds,
        batch_size=batch_size,
        peak_cache_tokens=result.peak_cache_tokens,
        final_cache_tokens=result.final_cache_tokens,
        evictions=result.evictions,
        text=result.text,
    )


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def prepare_folder(folder: Path, config: EvalConfig) -> None:
    """Creates the run folder, or checks a saved config.json against `config` before resuming."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.json"
    current = saved_form(config)
    if config_path.exists():
        check_compatible(json.loads(config_path.read_text(encoding="utf-8")), current, folder)
    _write_json_atomic(config_path, current)


@contextmanager
def _exclusive_append(path: Path) -> Iterator[IO[str]]:
    """Opens `path` for appending under an exclusive lock: two writers of one shard file would
    duplicate examples, so the second one fails fast instead."""
    with path.open("a", encoding="utf-8") as handle:
        try:
            import fcntl
        except ModuleNotFoundError:  # not POSIX: no advisory locks, rely on the user
            yield handle
            return
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise RunFolderBusyError(
                f"another process is already writing {path}: wait for it, or use another --out"
            ) from err
        yield handle


def _check_resolved_policy(folder: Path, resolved: dict[str, Any] | None) -> None:
    """Save the policy as the engine resolved it (bands from a profile, defaults) in policy.json, or,
    when resuming, refuse to continue under a policy that resolves differently (a profile changed)."""
    if resolved is None:
        return
    path = folder / "policy.json"
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved != json.loads(json.dumps(resolved)):
            changed = sorted(k for k in set(saved) | set(resolved) if saved.get(k) != resolved.get(k))
            raise ConfigMismatchError(
                f"{folder}: the policy now resolves differently from the saved policy.json "
                f"(fields {changed}); pin them with --policy-param or use a new --out"
            )
        return
    _write_json_atomic(path, resolved)


def _generate_all(
    config: EvalConfig, task: Task, work: list[WorkItem], generator: Generator, handle: IO[str]
) -> None:
    _check_resolved_policy(Path(handle.name).parent, getattr(generator, "resolved_policy", None))
    loop_config = LoopConfig()
    correct = finished = 0
    label = f"{task.name} {config.policy} {config.budget_label}"
    with tqdm(total=len(work), desc=label, disable=not config.progress) as bar:
        for group in batches(work, config.batch_size):
            sampling = make_sampling(
                max_new_tokens=config.max_new_tokens or task.max_new_tokens,  # resolved by run_eval
                temperature=config.temperature,
                top_p=config.top_p,
                seed=config.seed + group[0].sample,
            )
            prompts = [build_messages(item.example.problem, config.system_prompt) for item in group]
            results = list(generator(prompts, sampling))
            if len(results) != len(group):
                raise RuntimeError(f"generator returned {len(results)} results for {len(group)} prompts")
            for item, result in zip(group, results, strict=True):
                record = make_record(task, item, result, len(group), loop_config)
                append_result(handle, record)
                correct += record.correct
            finished += len(group)
            bar.update(len(group))
            bar.set_postfix(acc=f"{correct / finished:.3f}")


def _done_keys(folder: Path) -> set[tuple[str, int]]:
    """(id, sample) pairs with a result or a skip record in any file of the folder."""
    if not folder.is_dir():
        return set()
    return {r.key for r in load_run_results(folder)} | {r.key for r in load_skipped(folder)}


@dataclass
class RunPlan:
    """One config resolved against its task, and the (example, sample) pairs this shard owes.
    Planning writes nothing: a plan that is never run leaves no trace."""

    config: EvalConfig
    task: Task
    folder: Path
    shard: tuple[int, int]
    work: list[WorkItem]

    @property
    def label(self) -> str:
        return f"{self.config.policy} {self.config.budget_label}"

    @property
    def owed_examples(self) -> list[Example]:
        return list({item.example.id: item.example for item in self.work}.values())


def plan_run(config: EvalConfig) -> RunPlan:
    """Loads and slices the task, checks a saved config.json against ``config`` and lists the work
    left, without creating anything."""
    task = load_task(config.dataset).slice(config.offset, config.limit)
    config = resolve(config, task.max_new_tokens)
    folder = run_dir(config, task.name)
    config_path = folder / "config.json"
    if config_path.is_file():
        check_compatible(json.loads(config_path.read_text(encoding="utf-8")), saved_form(config), folder)
    shard = parse_shard(config.shard)
    return RunPlan(config, task, folder, shard, plan_work(task, config.n_samples, shard, _done_keys(folder)))


def check_plan(plan: RunPlan, generator: Generator) -> FitReport:
    """Which of the plan's owed problems cannot run under ``generator`` (see ``fit.py``)."""
    return check_fit(generator, plan.owed_examples, plan.config.system_prompt, plan.label)


def execute(plan: RunPlan, generator: Generator | None, skip: FitReport | None = None) -> RunOutcome:
    """Runs a plan: the problems in ``skip`` are recorded as skipped, the rest generated and graded;
    then summary.json. Work is listed again under the results file's lock (another shard may have
    finished some); ``generator`` may be None only when the plan owed nothing."""
    config, folder = plan.config, plan.folder
    prepare_folder(folder, config)
    results_path = folder / results_filename(*plan.shard)
    unfit = {u.example.id: u for u in (skip.unfit if skip else ())}
    with _exclusive_append(results_path) as handle:
        repair_tail(results_path)
        work = plan_work(plan.task, config.n_samples, plan.shard, _done_keys(folder))
        skipped = [item for item in work if item.example.id in unfit]
        work = [item for item in work if item.example.id not in unfit]
        _record_skipped(folder / results_filename(*plan.shard, kind="skipped"), skipped, unfit)
        if work:
            if generator is None:
                raise RuntimeError(f"{folder}: {len(work)} examples appeared to generate without a generator")
            _generate_all(config, plan.task, work, generator, handle)
    summary = summarize(load_run_results(folder), load_skipped(folder))
    summary["n_expected"] = len(plan.task) * config.n_samples
    _write_json_atomic(folder / "summary.json", summary)
    return RunOutcome(folder, config, len(work), summary, len(skipped))


def _record_skipped(path: Path, items: list[WorkItem], unfit: dict[str, Unfit]) -> None:
    if not items:
        return
    with path.open("a", encoding="utf-8") as handle:
        for item in items:
            why = unfit[item.example.id]
            record = SkippedExample(item.example.id, item.sample, why.problem, why.prompt_tokens)
            append_result(handle, record)


def run_eval(config: EvalConfig, make_generator: GeneratorFactory, skip_unfit: bool = False) -> RunOutcome:
    """Runs (or resumes) one config and writes summary.json; returns what it did.

    Finished (id, sample) pairs found in any results file of the folder are skipped. The generator
    is only built when something is left to generate, so a finished run never loads a model. Every
    owed prompt is checked before any generation: one that cannot run stops the run before anything
    is written (:class:`~epikv.eval.fit.UnfitPromptsError`), or with ``skip_unfit`` is recorded as
    skipped.
    """
    plan = plan_run(config)
    generator = make_generator(plan.config.policy, plan.config.budget) if plan.work else None
    report = check_plan(plan, generator) if generator is not None else None
    if report is not None and report.unfit and not skip_unfit:
        raise unfit_error([report])
    return execute(plan, generator, report)
