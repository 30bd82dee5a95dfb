"""Command-line glue for `epikv eval` and `epikv report`.

Owns argument parsing, turning arguments into `EvalConfig`s (one per policy × budget) and the order
of an eval: plan every run and say what was selected, check every owed prompt under every run, and
only then generate. The top-level `epikv` parser lives in `epikv.cli` and calls `add_eval_parser` /
`add_report_parser`.
The model is reached only through `_default_generator_factory` (`generator.engine_for_model`), which
imports the engine lazily so that argument parsing, reports and tests never load a model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epikv.errors import Interrupted
from epikv.eval.config import ENGINES, EvalConfig
from epikv.eval.fit import unfit_error
from epikv.eval.generator import (
    EngineFactory,
    Generator,
    engine_for_config,
    engine_for_model,
    generator_factory,
)
from epikv.eval.plan import describe_selection
from epikv.eval.plots import draw_all
from epikv.eval.ray_runner import add_ray_arguments, ray_eval_command, ray_requested
from epikv.eval.records import load_run_results
from epikv.eval.report import format_table
from epikv.eval.runner import RunOutcome, RunPlan, check_plan, execute, plan_run
from epikv.eval.runs import RunSummary, load_runs
from epikv.models.loading import DTYPE_CHOICES, DTYPE_HELP, resolve_dtype
from epikv.outputs import check_output_dir
from epikv.policies import policy_class
from epikv.spec import RANK_EVERY_HELP, budget_at_peak, parse_budget, parse_policy_params, parse_rank_every
from epikv.threads import THREADS_HELP, apply_threads, parse_threads

# The engine for `--model`; a module attribute so that tests can replace it.
_default_generator_factory = engine_for_model


def parse_budget_arg(text: str) -> int:
    """`--budget`: a positive number of tokens (:func:`epikv.spec.parse_budget`, one meaning everywhere)."""
    try:
        return parse_budget(text)  # type: ignore[return-value]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `eval` to an argparse subparsers object; the handler is set as `func`."""
    parser = subparsers.add_parser("eval", help="evaluate KV-cache policies on a math benchmark")
    parser.add_argument("--model", default=None, help="model name or path (engine default if omitted)")
    parser.add_argument(
        "--dataset", required=True, help="math500, aime2024, amc2023, gsm8k, a .jsonl or hf:NAME"
    )
    parser.add_argument("--policy", action="append", required=True, help="eviction policy (repeatable)")
    parser.add_argument(
        "--budget",
        action="append",
        type=parse_budget_arg,
        default=[],
        help="KV budget in tokens (repeatable); every evicting policy runs at each, `full` runs once",
    )
    parser.add_argument(
        "--peak",
        action="append",
        type=parse_budget_arg,
        default=[],
        help="equal peak memory (repeatable): each evicting policy runs at K = peak - tau, its own tau",
    )
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the task's cap")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--shard", default=None, help="I/N: run examples with index %% N == I")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=1, help="samples per problem (pass@1 = mean)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=int, default=None, help="eviction interval in decode steps")
    parser.add_argument("--rank-every", default=None, metavar="N", help=RANK_EVERY_HELP)
    parser.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy hyperparameter, parsed by the policy's field type (repeatable)",
    )
    parser.add_argument(
        "--skip-unfit",
        action="store_true",
        help="record problems whose prompt cannot run under a (policy, budget) as skipped "
        "(counted apart, never as wrong) instead of stopping before any work",
    )
    parser.add_argument("--threads", default="auto", help=THREADS_HELP + " (local runs)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help=DTYPE_HELP + "; saved resolved (default float32)",
    )
    parser.add_argument(
        "--engine",
        default="epikv",
        choices=ENGINES,
        help="what generates: epikv's own engine, or vLLM with the epikv plugin (eager, or vLLM's "
        "compiled default); a vLLM batch is one generate call with every prompt of --batch-size at once",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="the Python that runs vLLM (default: $EPIKV_VLLM_PYTHON, this one if it has vLLM, "
        "else .venv-vllm/bin/python)",
    )
    add_ray_arguments(parser)
    parser.set_defaults(func=eval_command)
    return parser


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `report` to an argparse subparsers object; the handler is set as `func`."""
    parser = subparsers.add_parser("report", help="tabulate and plot finished runs")
    parser.add_argument("dirs", nargs="+", help="run folders or folders containing them")
    parser.add_argument("--plots", default=None, help="write PNG figures into this folder")
    parser.add_argument("--regrade", action="store_true", help="grade the stored completions again")
    parser.set_defaults(func=report_command)
    return parser


def configs_from_args(args: argparse.Namespace) -> list[EvalConfig]:
    """One config per (evicting policy, budget) and one per non-evicting policy (no budget), in the
    order given; duplicates are dropped. Policy parameters are parsed by each policy's field types.
    ``--rank-every`` (rho) goes to every evicting policy's config (at tau = 1, so a peak is K + 1)."""
    params = {p: parse_policy_params(policy_class(p), args.policy_param) for p in args.policy}
    peaks = getattr(args, "peak", [])
    rho = {p: parse_rank_every(getattr(args, "rank_every", None), _tau(args, params[p])) for p in args.policy}
    pairs: list[tuple[str, int | None]] = []
    for policy in args.policy:
        if not policy_class(policy).evicts:
            pairs.append((policy, None))
        elif not args.budget and not peaks:
            raise ValueError(f"policy {policy!r} evicts and needs --budget or --peak (a number of tokens)")
        else:
            pairs.extend((policy, budget) for budget in args.budget)
            tau = 1 if rho[policy] is not None else args.interval
            pairs.extend((policy, budget_at_peak(policy, p, tau, params[policy])) for p in peaks)
    dtype = str(resolve_dtype(args.dtype)[0]).removeprefix("torch.")
    configs = []
    for policy, budget in dict.fromkeys(pairs):
        configs.append(
            EvalConfig(
                dataset=args.dataset,
                policy=policy,
                budget=budget,
                out=args.out,
                model=args.model,
                limit=args.limit,
                offset=args.offset,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                n_samples=args.samples,
                seed=args.seed,
                batch_size=args.batch_size,
                shard=args.shard,
                interval=args.interval,
                rank_every=rho[policy] if policy_class(policy).evicts else None,
                policy_params=json.loads(json.dumps(params[policy])),  # saved (JSON) form: tuples as lists
                progress=not args.no_progress,
                dtype=dtype,
                engine=getattr(args, "engine", "epikv"),
                vllm_python=getattr(args, "vllm_python", None),
            )
        )
    return configs


def _tau(args: argparse.Namespace, params: dict[str, Any]) -> int | None:
    """The interval a policy runs at as asked (None: its own), which ``--rank-every`` must find 1."""
    return args.interval if args.interval is not None else params.get("interval")


def eval_command(args: argparse.Namespace, engine: EngineFactory | None = None) -> int:
    """Plans every (policy, budget) config and checks every owed prompt under each before anything
    is generated; then runs them and prints the table of the runs it touched."""
    configs = configs_from_args(args)  # a ValueError is one line from `epikv` (epikv.errors)
    threads = getattr(args, "threads", "auto")
    parse_threads(threads)
    check_output_dir(args.out)
    if ray_requested(args):
        if configs[0].engine != "epikv":
            raise ValueError(f"--ray runs epikv's own engine; --engine {configs[0].engine} runs here only")
        return ray_eval_command(args, configs, engine)
    plans = [plan_run(config) for config in configs]
    print(describe_selection(plans), flush=True)
    print(apply_threads(threads), flush=True)  # beside the selection: errors stay one line on stderr
    # Built only for runs that owe work, so a finished run never loads a model.
    engines: dict[str, EngineFactory] = {}  # epikv's engine is made once and serves every run
    generators = [_build(engine or _engine(p.config, engines), p.config) if p.work else None for p in plans]
    checks = [check_plan(p, g) if g is not None else None for p, g in zip(plans, generators, strict=True)]
    unfit = [c for c in checks if c is not None and c.unfit]
    if unfit and not args.skip_unfit:
        raise unfit_error(unfit)
    for check in unfit:
        print(f"skipping (--skip-unfit): {check.describe()}")
    runs: list[RunSummary] = []
    try:
        for plan, generator, check in zip(plans, generators, checks, strict=True):
            outcome = execute(plan, generator, check)
            _save_spec(outcome.folder, generator)
            getattr(generator, "close", lambda: None)()  # a vLLM worker ends with its run
            config = outcome.config
            runs.append(
                RunSummary(outcome.folder, plan.task.name, config.policy, config.budget, outcome.summary)
            )
            print(_outcome_line(outcome))
    except KeyboardInterrupt:
        raise Interrupted(_kept(plans, len(runs), args.out)) from None
    print(format_table(runs))  # the selection's numbers (`epikv report` counts whole folders)
    return 0


def _outcome_line(outcome: RunOutcome) -> str:
    s = outcome.summary
    shown = "–" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
    line = f"{outcome.folder}: generated {outcome.generated}, skipped {outcome.skipped}, accuracy {shown}"
    if s["n_outside_selection"]:
        line += f" ({s['n_outside_selection']} more records in the folder are outside this selection)"
    return line


def _kept(plans: Sequence[RunPlan], finished: int, out: str) -> str:
    """What an interrupted eval leaves: every result already written stays, and resuming skips them."""
    results = sum(len(load_run_results(p.folder)) for p in plans if p.folder.is_dir())
    return (
        f"{results} results are kept under {out} ({finished} of {len(plans)} runs finished); "
        "run the same command again to resume"
    )


def _engine(config: EvalConfig, made: dict[str, EngineFactory]) -> EngineFactory:
    """The engine of a resolved config: epikv's through the module-level factory (resolved at call
    time, so tests can replace it; made once, kept in ``made``), vLLM's through
    :func:`engine_for_config` (one worker per run)."""
    if config.engine != "epikv":
        return engine_for_config(config)
    if "epikv" not in made:
        made["epikv"] = _default_generator_factory(config.model, dtype=config.dtype)
    return made["epikv"]


def _build(engine: EngineFactory, config: EvalConfig) -> Generator:
    """The run's generator; the spec it resolved (policy, budget, the bands and which profile they came
    from) is said on stderr."""
    generator = generator_factory(engine, config)(config.policy, config.budget)
    if generator.spec is not None:
        print(f"[epikv] {generator.spec.describe()}", file=sys.stderr)
    return generator


def _save_spec(folder: Path, generator: Generator | None) -> None:
    """The resolved spec as the run's ``spec.json`` (nothing when no generator was built or it has none)."""
    if generator is not None and generator.spec is not None:
        (folder / "spec.json").write_text(
            json.dumps(generator.spec.record(), indent=2) + "\n", encoding="utf-8"
        )


def report_command(args: argparse.Namespace) -> int:
    """Prints the table of every run under the given folders, then draws the figures if asked."""
    if args.plots:
        check_output_dir(args.plots, "--plots")
    runs = load_runs(args.dirs, regrade_text=getattr(args, "regrade", False))
    # The table goes out before any figure is drawn, so a plotting failure cannot hide it (issue #12).
    print(format_table(runs), flush=True)
    if args.plots:
        draw_all(runs, Path(args.plots))
        for path in sorted(Path(args.plots).glob("*.png")):
            print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser with both subcommands (for `python -m epikv.eval.cli` and tests)."""
    parser = argparse.ArgumentParser(prog="epikv")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(subparsers)
    add_report_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
