"""``epikv bench <kind> [--model M] [--quick] --out DIR`` and ``epikv bench plot RESULT.json``.

Thin: flags become fields of the kind's config dataclass (over its ``QUICK`` preset with ``--quick``,
else over its defaults), the kind's ``run_*`` function makes the document, it is written as
``DIR/<kind>.json`` and drawn as ``DIR/<kind>.png`` by the kind's ``plot_*`` function from the file.
While it runs, stderr shows one line per cache spec it uses (policy, budget, bands and their profile;
also recorded in the result's config) and a progress bar (``--no-progress`` hides it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epikv.bench.accuracy.cli import add_accuracy_parser
from epikv.bench.accuracy.frontier_cli import add_frontier_parser
from epikv.bench.shared import documents
from epikv.outputs import check_output_dir, check_output_file
from epikv.spec import RANK_EVERY_HELP

KINDS = ("memory", "speed", "step", "fidelity", "loops", "capacity", "peer", "serve", "goodput")
# One line each for `epikv bench --help` (the run functions' docstrings are written for readers of code).
KIND_HELP = {
    "memory": "peak memory of one forward: eager vs SDPA vs EpiKV's capture",
    "speed": "decode tokens/s and compaction cost of each policy",
    "step": "decode step time against the memory-traffic bound",
    "fidelity": "agreement and KL with the full cache, per policy and budget",
    "loops": "free-running loops, cap hits and accuracy at equal peak memory",
    "capacity": "requests that fit in GPU memory per context (no model runs)",
    "peer": "side by side with NVIDIA kvpress: speed, memory, kept set",
    "serve": "epikv serve under concurrent clients: throughput, latency",
    "goodput": "correct answers per minute from a fixed KV pool, through vLLM",
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _gb_or_auto(text: str) -> float | None:
    return None if text == "auto" else float(text)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


# flag -> (config field, type, help); only the flags a kind's config has are added to its parser.
_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--device": ("device", str, "cpu or cuda"),
    "--dtype": ("dtype", str, "model weights dtype (float32, bfloat16...)"),
    "--threads": ("threads", int, "torch CPU threads (default 1: stable timings on a shared machine)"),
    "--policies": ("policies", _names, "comma-separated policies (missing ones are reported, not fatal)"),
    "--budget": ("budget", int, "KV budget K in tokens"),
    "--batches": ("batches", _ints, "comma-separated batch sizes"),
    "--dtypes": ("dtypes", _names, "comma-separated dtypes (float32,bfloat16)"),
    "--budgets": ("budgets", _ints, "comma-separated budgets"),
    "--interval": ("interval", int, "compaction interval tau (default: each policy's own)"),
    "--rank-every": ("rank_every", int, RANK_EVERY_HELP),
    "--pool-tokens": ("pool_tokens", int, "KV pool in tokens (default: 8 full requests at the cap)"),
    "--tokens": ("tokens", int, "forced decode tokens (EOS ignored)"),
    "--repeats": ("repeats", int, "interleaved repeats of every policy"),
    "--chunk": ("chunk", int, "decode steps each policy runs per turn (policies take turns)"),
    "--bin-size": ("bin_size", int, "decode steps per point of the speed-vs-position series"),
    "--attention": ("attention", str, "attention rows for attention-scored policies: eager | recompute"),
    "--prompt-source": ("prompt_source", str, "bundled task (math500, gsm8k...) or a .jsonl / text file"),
    "--prompt-index": ("prompt_index", int, "which prompt of the source"),
    "--prompts": ("prompts", int, "how many prompts"),
    "--prompt-offset": ("prompt_offset", int, "first prompt of the source"),
    "--trace-tokens": ("trace_tokens", int, "length T of each full-cache trace"),
    "--genres": (
        "genres",
        _names,
        "fidelity genres (bench/fidelity/genres): prose,code,gsm8k-greedy...",
    ),
    "--prompt-tokens": ("prompt_tokens", int, "prompt length of forced genres"),
    "--max-prompt-tokens": ("max_prompt_tokens", int, "skip longer prompts of generated genres"),
    "--peaks": ("peaks", _ints, "equal peak memory: each policy's K = peak - tau, for these peaks"),
    "--peak": ("peak", int, "equal peak memory: each policy's K = this - tau (instead of --budget)"),
    "--reference": ("reference", str, "policy the others are compared with, paired over prompts"),
    "--free-run": ("free_run", str, "free running: none | generated (genres whose text the model writes)"),
    "--tail-tokens": ("tail_tokens", int, "common window: the last N positions of every trace"),
    "--datasets": ("datasets", _names, "comma-separated eval datasets (gsm8k, math500, a .jsonl...)"),
    "--problems": ("problems", _ints, "problems per dataset, comma-separated"),
    "--offsets": ("offsets", _ints, "first problem of each dataset, comma-separated"),
    "--max-new-tokens": ("max_new_tokens", int, "length cap of each generation (EOS stops earlier)"),
    "--sweep-policies": ("sweep_policies", _names, "policies also run at each --sweep-budgets K"),
    "--sweep-budgets": ("sweep_budgets", _ints, "equal-K sweep: comma-separated budgets"),
    "--references": ("references", _names, "policies every cell is tested against (paired)"),
    "--loop-min-span": ("loop_min_span", int, "loop detector: the periodic tail covers this many tokens"),
    "--shard": ("shard", str, "I/N: compute shard I of N only (parts are kept for the run that assembles)"),
    "--shards": ("shards", int, "with --ray: shards run as Ray tasks"),
    "--ray": ("ray", str, "run --shards shards as Ray tasks: ADDRESS (auto, HOST:PORT) or local"),
    "--batch-size": ("batch_size", int, "prompts decoded together (one engine batch)"),
    # Issue 28: cells added to a finished study share its parts (its `full` among them) but write
    # their own document, so the study's is not overwritten.
    "--parts-dir": ("parts_dir", str, "finished parts to reuse and add to (default: OUT/<kind>-parts)"),
    "--min-length": ("min_length", int, "first forward length (doubles up to --max-length)"),
    "--max-length": ("max_length", int, "longest forward length tried"),
    "--cap-gb": ("cap_gb", float, "memory cap: GB above the loaded model (CPU) or emulated GPU size (CUDA)"),
    "--paths": ("paths", _names, "memory paths: attention_outputs,sdpa,epikv_capture"),
    "--timeout": ("timeout_s", float, "seconds allowed per subprocess"),
    "--gpu-gb": ("gpu_gb", float, "accelerator memory M in GB (2**30 bytes)"),
    "--usable": ("usable", float, "usable fraction u of that memory"),
    "--weights-gb": ("weights_gb", _gb_or_auto, "weights W in GB, or auto = parameters x bytes"),
    "--dtype-bytes": ("dtype_bytes", int, "bytes per KV element"),
    "--contexts": ("contexts", _ints, "comma-separated context lengths"),
    "--slack": ("slack", int, "tokens held above K between compactions (0 in the paper)"),
    "--presses": ("presses", _names, "kvpress bases: streaming,knorm,tova,observed"),
    "--ours": ("ours", _names, "our policies to run against kvpress"),
    "--venv": ("venv", str, "kvpress virtual environment folder (created if missing)"),
    "--torch-spec": ("torch_spec", str, "torch requirement installed there (default: our version)"),
    "--concurrency": ("concurrency", _ints, "comma-separated numbers of concurrent clients"),
    "--max-tokens": ("max_tokens", int, "new tokens per request (EOS ignored)"),
    "--rounds": ("rounds", int, "requests each client sends per concurrency level"),
    "--pool-requests": (
        "pool_requests",
        int,
        "capacity run: KV pool = this many full-cache requests (0: skip)",
    ),
    "--capacity-waves": ("capacity_waves", int, "capacity run: requests = waves x what the pool admits"),
    "--soak": (
        "soak_s",
        float,
        "serve: bursts at twice --soak-rows for this many seconds, instead of the sweep",
    ),
    "--soak-rows": ("soak_rows", int, "serve soak: requests the server runs at once (--max-batch)"),
}
_SWITCHES = {"--stop-at-eos": "stop_at_eos", "--no-chat": "chat", "--eager": "eager"}


def _kind(kind: str) -> tuple[Any, Any, Callable[..., dict], Callable[..., Path]]:
    module = importlib.import_module(f"epikv.bench.{kind}.study")
    config_class = next(  # the kind's own config, not one it imports (loops imports eval's LoopConfig)
        v
        for k, v in vars(module).items()
        if k.endswith("Config") and dataclasses.is_dataclass(v) and v.__module__ == module.__name__
    )
    return config_class, module.QUICK, getattr(module, f"run_{kind}"), getattr(module, f"plot_{kind}")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: speed, step, fidelity, loops, serve, ...")
    kinds = bench.add_subparsers(dest="bench_kind", required=True, title="benchmarks", metavar="KIND")
    for kind in KINDS:
        config_class = _kind(kind)[0]
        fields = {f.name for f in dataclasses.fields(config_class)}
        p = kinds.add_parser(kind, help=KIND_HELP[kind], description=KIND_HELP[kind])
        p.add_argument("--out", required=True, help="folder for <kind>.json and <kind>.png")
        p.add_argument("--quick", action="store_true", help="the small configuration (~2 min on 2 cores)")
        p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
        if "model" in fields:
            p.add_argument("--model", default=argparse.SUPPRESS, help="hub id, folder, random:<preset>")
        for flag, (name, kind_type, text) in _FLAGS.items():
            if name in fields:
                p.add_argument(flag, dest=name, type=kind_type, default=argparse.SUPPRESS, help=text)
        for flag, name in _SWITCHES.items():
            if name in fields:
                p.add_argument(
                    flag,
                    dest=name,
                    action="store_const",
                    const=flag != "--no-chat",
                    default=argparse.SUPPRESS,
                )
        p.set_defaults(func=cmd_bench, kind=kind)
    plot = kinds.add_parser("plot", help="redraw a figure from a result JSON alone")
    plot.add_argument("result", help="a <kind>.json written by epikv bench")
    plot.add_argument("--png", default=None, help="output path (default: beside the JSON)")
    plot.set_defaults(func=cmd_plot)
    table = kinds.add_parser("table", help="print a fidelity or loops result as markdown tables")
    table.add_argument("result", help="a fidelity.json or loops.json written by epikv bench")
    table.add_argument("--metric", default="agreement_tail", help="the column rows are ranked by")
    table.add_argument("--genres", type=_names, default=None, help="fidelity result: genres to print")
    table.add_argument("--datasets", type=_names, default=None, help="loops result: datasets to print")
    table.set_defaults(func=cmd_table)
    regrade = kinds.add_parser("regrade", help="grade a loops result's stored generations again (issue 58)")
    regrade.add_argument("result", nargs="+", help="loops.json documents written by epikv bench loops")
    regrade.add_argument("--parts-dir", default=None, help="their parts (default: the folder each records)")
    regrade.set_defaults(func=cmd_regrade)
    add_accuracy_parser(kinds)
    add_frontier_parser(kinds)


def build_config(kind: str, args: argparse.Namespace) -> Any:
    config_class, quick, _, _ = _kind(kind)
    base = quick if args.quick else config_class()
    names = {f.name for f in dataclasses.fields(config_class)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if "parts_dir" in names and "parts_dir" not in given:  # finished cells kept for a rerun
        given["parts_dir"] = str(Path(args.out) / f"{kind}-parts")
    return dataclasses.replace(base, **given)


def cmd_bench(args: argparse.Namespace) -> int:
    config = build_config(args.kind, args)
    check_output_dir(args.out)  # before minutes of measuring (issue #12)
    _, _, run, plot = _kind(args.kind)
    document = run(config, reporter=documents.Reporter(announce=_announce, progress=not args.no_progress))
    if not document["config"].get("cache_specs"):
        _announce(f"bench {args.kind}: no cache ran, so no policy read bands from a profile")
    path = documents.write_result(document, args.out)
    print(path)
    print(plot(path))
    return 0


def _announce(line: str) -> None:
    """One line on stderr per cache spec a benchmark runs: policy, budget, bands and their profile."""
    from tqdm.auto import tqdm

    tqdm.write(f"[epikv] {line}", file=sys.stderr)  # above a running bar, not through it


def cmd_table(args: argparse.Namespace) -> int:
    from epikv.bench.fidelity.summary import METRICS, markdown
    from epikv.bench.loops import summary as loops_summary

    data = documents.read_result(args.result)
    if data["kind"] not in ("fidelity", "loops"):
        raise ValueError(f"{args.result}: a {data['kind']!r} result has no tables (fidelity, loops have)")
    summary = data["results"]["summary"]
    wrong = "--genres" if data["kind"] == "loops" and args.genres else None
    wrong = "--datasets" if data["kind"] == "fidelity" and args.datasets else wrong
    if wrong:
        right = "--datasets" if wrong == "--genres" else "--genres"
        raise ValueError(f"{wrong}: a {data['kind']} result is split by {right[2:]}; give {right}")
    if data["kind"] == "loops":
        unknown = sorted(set(args.datasets or ()) - set(summary["datasets"]))
        if unknown:
            have = ", ".join(summary["datasets"])
            raise ValueError(f"--datasets {','.join(unknown)}: the result has {have}")
        print(loops_summary.markdown(summary, args.datasets))
        return 0
    if args.metric not in METRICS:
        raise ValueError(f"--metric {args.metric!r} is not one of {', '.join(METRICS)}")
    unknown = sorted(set(args.genres or ()) - set(summary["genres"]))
    if unknown:
        raise ValueError(f"--genres {','.join(unknown)}: the result has {', '.join(summary['genres'])}")
    print(markdown(summary, args.genres, args.metric))
    return 0


def cmd_regrade(args: argparse.Namespace) -> int:
    """Each loops document's generations graded again from its parts by the current rules; where a
    verdict moved, its summary, tables and figure are re-made and ``regrade.json`` lists the moves."""
    from epikv.bench.loops.regrade import regrade_document
    from epikv.bench.shared.model_loading import load_bench_tokenizer

    tokenizers: dict[Any, Any] = {}
    for result in args.result:
        model = documents.read_result(result, "loops")["config"].get("model")
        if model not in tokenizers:
            tokenizers[model] = load_bench_tokenizer(model)
        found = regrade_document(result, args.parts_dir, tokenizers[model])
        print(
            f"{result}: {found['records']} generations graded again, {found['parts_records_updated']} "
            f"part records and {found['updated']} facts updated, {len(found['moved'])} verdicts moved"
        )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    if args.png is not None:
        check_output_file(args.png, "--png")
    kind = documents.read_result(args.result)["kind"]
    if kind not in KINDS:
        raise ValueError(f"{args.result}: unknown benchmark kind {kind!r}")
    print(_kind(kind)[3](args.result, args.png))
    return 0
