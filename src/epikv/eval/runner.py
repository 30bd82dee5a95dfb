"""Running one evaluation config: check, generate in batches, grade, record, summarise.

Owns the run folder's life cycle: the check of every owed prompt before any generation (``fit.py``),
creating the folder (or resuming it under a lock), batched calls to the generator, appending each
graded record as it finishes, recording the problems that were skipped, a summary of the selection,
and removing the folder of a run that failed before its first record. What a run owes is
``plan.py``'s. It never grades by itself (the task does) and never knows the model or policy beyond
the names it passes to the generator factory.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tqdm.auto import tqdm

from epikv.eval.config import (
    ConfigMismatchError,
    EvalConfig,
    check_compatible,
    saved_form,
)
from epikv.eval.fit import FitReport, Unfit, check_fit, unfit_error
from epikv.eval.generator import Generator, GeneratorFactory, make_sampling
from epikv.eval.loops import LoopConfig, detect_loop
from epikv.eval.metrics import summarize
from epikv.eval.plan import RunPlan, WorkItem, batches, done_keys, plan_run, plan_work
from epikv.eval.prompts import build_messages
from epikv.eval.records import (
    RESULTS_GLOB,
    SKIPPED_GLOB,
    ExampleResult,
    SkippedExample,
    append_result,
    load_run_results,
    load_skipped,
    repair_tail,
    results_filename,
)
from epikv.eval.tasks import Task

if TYPE_CHECKING:
    from epikv.engine import Completion

__all__ = [
    "RunFolderBusyError", "RunOutcome", "RunPlan", "WorkItem", "batches", "check_plan", "execute",
    "plan_run", "plan_work", "run_eval",
]  # fmt: skip


class RunFolderBusyError(OSError):
    """Another process holds the lock of this run folder's results file (a concurrent eval)."""


@dataclass(frozen=True)
class RunOutcome:
    folder: Path
    config: EvalConfig
    generated: int
    summary: dict[str, Any]
    skipped: int = 0


def make_record(
    task: Task, item: WorkItem, result: Completion, batch_size: int, loop_config: LoopConfig
) -> ExampleResult:
    grade = task.evaluate(item.example, result.text, cut=result.finish_reason == "length")
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
        mean_cache_tokens=result.mean_cache_tokens,
        token_ids=list(result.token_ids),
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
    _check_resolved_policy(Path(handle.name).parent, generator.resolved_policy)
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


def check_plan(plan: RunPlan, generator: Generator) -> FitReport:
    """Which of the plan's owed problems cannot run under ``generator`` (see ``fit.py``)."""
    return check_fit(generator, plan.owed_examples, plan.config.system_prompt, plan.label)


def execute(plan: RunPlan, generator: Generator | None, skip: FitReport | None = None) -> RunOutcome:
    """Runs a plan: the problems in ``skip`` are recorded as skipped, the rest generated and graded;
    then summary.json. Work is listed again under the results file's lock (another shard may have
    finished some); ``generator`` may be None only when the plan owed nothing. A run that fails (or
    is interrupted) before its first record leaves no run folder behind."""
    config, folder = plan.config, plan.folder
    own = [folder / results_filename(*plan.shard, kind=kind) for kind in ("results", "skipped")]
    unfit = {u.example.id: u for u in (skip.unfit if skip else ())}
    prepare_folder(folder, config)
    with _exclusive_append(own[0]) as handle:
        try:
            repair_tail(own[0])
            work = plan_work(plan.task, config.n_samples, plan.shard, done_keys(folder))
            skipped = [item for item in work if item.example.id in unfit]
            work = [item for item in work if item.example.id not in unfit]
            _record_skipped(own[1], skipped, unfit)
            if work:
                if generator is None:
                    raise RuntimeError(f"{folder}: {len(work)} examples to generate and no generator")
                _generate_all(config, plan.task, work, generator, handle)
        except BaseException:
            _discard_if_empty(folder, own, Path(config.out))  # under the lock: no other writer of ours
            raise
    summary = summarize_selection(plan)
    _write_json_atomic(folder / "summary.json", summary)
    return RunOutcome(folder, config, len(work), summary, len(skipped))


def summarize_selection(plan: RunPlan) -> dict[str, Any]:
    """summary.json: the metrics of the selected (problem, sample) pairs, what was selected, and how
    many records the folder holds outside the selection (an earlier, larger --limit): kept, not counted."""
    selected = plan.selected_keys
    records = load_run_results(plan.folder)
    skipped = load_skipped(plan.folder)
    summary = summarize([r for r in records if r.key in selected], [s for s in skipped if s.key in selected])
    summary["n_expected"] = len(selected)
    summary["n_outside_selection"] = sum(r.key not in selected for r in [*records, *skipped])
    summary["selection"] = plan.selection()
    return summary


def _discard_if_empty(folder: Path, own: list[Path], out: Path) -> None:
    """After a failure: when the folder holds no record (ours or another shard's), remove what this
    run wrote and the folders left empty up to ``out``, so no empty run haunts `report` (#12)."""
    if not folder.is_dir():
        return
    files = [*folder.glob(RESULTS_GLOB), *folder.glob(SKIPPED_GLOB)]
    if any(path not in own or path.stat().st_size for path in files):
        return
    for name in (*(path.name for path in own), "config.json", "policy.json", "summary.json"):
        with contextlib.suppress(OSError):
            (folder / name).unlink(missing_ok=True)
    out = out.absolute()
    for empty in (folder.absolute(), *folder.absolute().parents):
        if empty == out or out not in empty.parents:
            break
        try:
            empty.rmdir()
        except OSError:
            break


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
