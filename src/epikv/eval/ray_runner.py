"""`epikv eval --ray`: the shards of evaluation runs as Ray tasks.

Owns splitting runs into shard configs, one Ray task per shard, the terminal progress while they run
(read from the results files, see `progress.py`) and what each task returned or why it failed. A
task does nothing but `run_eval` on its shard config, so it writes exactly the files, records and
locks a local `--shard I/N` process writes: Ray and local shards mix in one run folder, a task
re-run after its worker died resumes where the dead one stopped (finished examples are skipped, the
shard file's lock keeps two writers out), and `epikv report` reads the folder unchanged. It does not
know models or policies; the engine is reached only inside the task.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from epikv.cluster import connected, gpus_or_default
from epikv.eval.config import EvalConfig, parse_shard, run_dir
from epikv.eval.generator import EngineFactory, engine_for_model, generator_factory
from epikv.eval.plan import done_keys
from epikv.eval.progress import Key, ResultsWatcher
from epikv.eval.report import report
from epikv.eval.runner import RunOutcome, plan_work, run_eval
from epikv.eval.tasks import Task, load_task

# Ray re-runs a task whose worker process or node died this many times (Ray's own default). An
# exception raised by the task itself (a config mismatch, a bad model name) is not retried: it
# would fail the same way again.
MAX_RETRIES = 3


@dataclass(frozen=True)
class RayOptions:
    """address: None = Ray's default (see `epikv.cluster.connected`); shards: tasks per run;
    gpus_per_task: None = 1 when the cluster has GPUs, else 0."""

    address: str | None = None
    shards: int = 1
    cpus_per_task: float = 1.0
    gpus_per_task: float | None = None
    max_retries: int = MAX_RETRIES
    poll_seconds: float = 1.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.cpus_per_task < 0 or (self.gpus_per_task is not None and self.gpus_per_task < 0):
            got = f"{self.cpus_per_task} CPUs, {self.gpus_per_task} GPUs"
            raise ValueError(f"task resources must be >= 0, got {got}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")


@dataclass(frozen=True)
class ShardFailure:
    config: EvalConfig
    error: str


@dataclass(frozen=True)
class RayRun:
    outcomes: list[RunOutcome]
    failures: list[ShardFailure]


def shard_configs(configs: list[EvalConfig], shards: int) -> list[EvalConfig]:
    """Each run split into `shards` shard configs; a config that names its shard stays that one shard.
    `out` is made absolute here, since a worker's working folder is not the driver's, and tasks never
    draw their own progress bar (the driver draws one for all)."""
    out = []
    for config in configs:
        names = [config.shard] if config.shard is not None else _shard_names(shards)
        where = str(Path(config.out).resolve())
        out.extend(replace(config, shard=name, out=where, progress=False) for name in names)
    return out


def _shard_names(shards: int) -> list[str | None]:
    return [None] if shards == 1 else [f"{index}/{shards}" for index in range(shards)]


def run_shard(
    config: EvalConfig, engine: EngineFactory | None = None, skip_unfit: bool = False
) -> RunOutcome:
    """What one Ray task does: `run_eval` on one shard config. `engine` None = the real engine with
    the config's model, loaded in the task's worker. The shard's prompts are checked before it
    generates: one that cannot run fails the task before it writes, or with ``skip_unfit`` is
    recorded as skipped."""
    factory = generator_factory(engine or engine_for_model(config.model, dtype=config.dtype), config)
    return run_eval(config, factory, skip_unfit)


def owed_work(configs: list[EvalConfig]) -> dict[Path, set[Key]]:
    """Per run folder, the (id, sample) keys the shard configs still owe (what progress counts)."""
    tasks: dict[tuple[str, int, int | None], Task] = {}
    done: dict[Path, set[Key]] = {}
    owed: dict[Path, set[Key]] = {}
    for config in configs:
        spec = (config.dataset, config.offset, config.limit)
        if spec not in tasks:
            tasks[spec] = load_task(config.dataset).slice(config.offset, config.limit)
        task = tasks[spec]
        folder = run_dir(config, task.name)
        if folder not in done:
            done[folder] = done_keys(folder)  # results and skipped problems
        work = plan_work(task, config.n_samples, parse_shard(config.shard), done[folder])
        owed.setdefault(folder, set()).update((item.example.id, item.sample) for item in work)
    return owed


def run_on_ray(
    configs: list[EvalConfig],
    options: RayOptions,
    engine: EngineFactory | None = None,
    skip_unfit: bool = False,
) -> RayRun:
    """Runs every shard of every config as a Ray task and waits for all of them; a failed task is
    reported in the result, never raised, so the other shards still finish."""
    shards = shard_configs(configs, options.shards)
    owed = owed_work(shards)
    with connected(options.address) as ray:
        resources = _task_resources(ray, options)
        remote = ray.remote(max_retries=options.max_retries, **resources)(run_shard)
        refs = {remote.options(name=_task_name(c)).remote(c, engine, skip_unfit): c for c in shards}
        total = sum(len(keys) for keys in owed.values())
        bar = tqdm(total=total, desc="ray eval", unit="ex", disable=not options.progress, file=sys.stderr)
        with bar:
            return _collect(ray, refs, _Progress(owed, bar), options.poll_seconds)


def _task_resources(ray: Any, options: RayOptions) -> dict[str, float]:
    return {"num_cpus": options.cpus_per_task, "num_gpus": gpus_or_default(ray, options.gpus_per_task)}


def _task_name(config: EvalConfig) -> str:
    return f"epikv-eval {config.dataset} {config.policy} {config.budget_label} shard {config.shard or '0/1'}"


class _Progress:
    """Advances the bar by the owed keys that newly appear in the results files."""

    def __init__(self, owed: dict[Path, set[Key]], bar: Any) -> None:
        self.owed, self.bar = owed, bar
        self.watcher = ResultsWatcher(list(owed))
        self.seen: dict[Path, set[Key]] = {folder: set() for folder in owed}

    def advance(self) -> None:
        for folder, keys in self.watcher.poll().items():
            new = (keys & self.owed[folder]) - self.seen[folder]
            self.seen[folder] |= new
            self.bar.update(len(new))


def _collect(ray: Any, refs: dict[Any, EvalConfig], progress: _Progress, poll_seconds: float) -> RayRun:
    outcomes: list[RunOutcome] = []
    failures: list[ShardFailure] = []
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_seconds)
        for ref in ready:
            try:
                outcomes.append(ray.get(ref))
            except Exception as err:  # any task error or lost worker; the others go on
                failure = ShardFailure(refs[ref], describe_task_error(err))
                failures.append(failure)
                progress.bar.write(f"failed: {_task_name(failure.config)}: {failure.error}", file=sys.stderr)
        progress.advance()
    return RayRun(outcomes, failures)


def describe_task_error(err: BaseException) -> str:
    """One line for a failed Ray task: the task's own exception type and first line."""
    cause = getattr(err, "cause", None) or err  # a RayTaskError carries the task's own exception
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


# -- command line ------------------------------------------------------------------------------------
def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--ray` flags of `epikv eval`."""
    group = parser.add_argument_group("Ray (pip install 'epikv[ray]')")
    group.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the shards as Ray tasks on the cluster at ADDRESS (auto, HOST:PORT, ray://HOST:10001); "
        "without ADDRESS: RAY_ADDRESS or a cluster started on this machine, else a new local instance",
    )
    group.add_argument("--shards", type=int, default=1, help="with --ray: Ray tasks per run (each one shard)")
    group.add_argument("--cpus-per-task", type=float, default=1.0, help="with --ray: CPUs each task reserves")
    group.add_argument(
        "--gpus-per-task",
        type=float,
        default=None,
        help="with --ray: GPUs each task reserves (default: 1 if the cluster has any)",
    )


def ray_requested(args: argparse.Namespace) -> bool:
    """Whether `--ray` was given; Ray-only flags without it are an error rather than ignored."""
    if getattr(args, "ray", None) is not None:
        return True
    defaults = {"shards": 1, "cpus_per_task": 1.0, "gpus_per_task": None}
    stray = [name for name, default in defaults.items() if getattr(args, name, default) != default]
    if stray:
        flags = ", ".join("--" + name.replace("_", "-") for name in stray)
        raise SystemExit(f"epikv eval: {flags} only apply with --ray")
    return False


def ray_eval_command(
    args: argparse.Namespace, configs: list[EvalConfig], engine: EngineFactory | None = None
) -> int:
    """Runs the configs' shards on Ray, then prints what each run generated and the table."""
    if args.shard is not None and args.shards != 1:
        raise SystemExit("epikv eval: give --shard I/N (that one shard) or --shards N (all N), not both")
    options = RayOptions(
        address=args.ray or None,
        shards=args.shards,
        cpus_per_task=args.cpus_per_task,
        gpus_per_task=args.gpus_per_task,
        progress=not args.no_progress,
    )
    try:
        run = run_on_ray(configs, options, engine, getattr(args, "skip_unfit", False))
    except KeyboardInterrupt:
        print("epikv eval: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    generated: dict[Path, int] = {}
    for outcome in run.outcomes:
        generated[outcome.folder] = generated.get(outcome.folder, 0) + outcome.generated
    for folder, count in generated.items():
        print(f"{folder}: generated {count}")
    visible = [folder for folder in generated if folder.is_dir()]  # a Ray Client driver may not see --out
    if visible:
        print(report(visible))
    if run.failures:
        for failure in run.failures:
            print(f"epikv eval: failed: {_task_name(failure.config)}: {failure.error}", file=sys.stderr)
        print("epikv eval: run the same command again to finish: finished examples are kept", file=sys.stderr)
        return 1
    return 0
