"""Command line: ``epikv generate``, ``epikv policies`` and the subsystems' commands.

This module parses arguments and prints; the work happens in the library. Errors a user can fix
(bad budget, unknown policy, missing package) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import sys
import time
from typing import Any

from epikv.errors import Interrupted, run_command
from epikv.models.loading import DTYPE_CHOICES, DTYPE_HELP
from epikv.policies import ALIASES, policy_class, policy_names
from epikv.spec import RANK_EVERY_HELP
from epikv.threads import THREADS_HELP, apply_threads


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text under a KV budget; report what the cache did")
    p.add_argument("prompt", help="the prompt (wrapped in the chat template unless --raw)")
    p.add_argument(
        "--model", default=None, help="hub id or local path (default: embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--policy", default="epikv", help="eviction policy (see `epikv policies`)")
    p.add_argument(
        "--budget", default="256", help="KV budget in tokens per sequence (ignored by the policy full)"
    )
    p.add_argument(
        "--interval", type=int, default=None, help="compaction interval tau (default: the policy's)"
    )
    p.add_argument("--rank-every", default=None, metavar="N", help=RANK_EVERY_HELP)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="policy hyperparameter")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--threads", default="auto", help=THREADS_HELP)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from epikv.generation import SamplingConfig, generate
    from epikv.integration import attention_implementation, build_spec
    from epikv.models import load_model, model_identity, resolve_dtype
    from epikv.spec import precheck

    # mistakes fail before the model loads
    budget = precheck(args.policy, args.budget, args.param, args.interval, args.rank_every)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.ignore_eos, args.seed)
    threads = apply_threads(args.threads)  # said after the model loads: a mistake stays one line
    dtype, dtype_note = resolve_dtype(args.dtype)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=dtype)
    load_seconds = time.perf_counter() - started
    spec = build_spec(
        model, args.policy, budget, interval=args.interval, params=args.param, rank_every=args.rank_every
    )
    policy = spec.policy
    print(f"[epikv] {spec.describe()}", file=sys.stderr)  # which bands, from which profile (issue 12)
    print(f"[epikv] {threads}; {dtype_note}", file=sys.stderr)
    streamer = None if args.json else _Streamer(tokenizer)
    try:
        result = generate(
            model,
            tokenizer,
            [args.prompt],
            spec,
            sampling=sampling,
            chat=not args.raw,
            on_token=None if streamer is None else streamer.push,
            on_prefill=_PrefillBar().update,
        )[0]
    except KeyboardInterrupt:
        if streamer is None:
            raise Interrupted("before the JSON report; generate writes no files") from None
        print()  # end the streamed text's line
        raise Interrupted(f"after {len(streamer.ids)} generated tokens (shown above)") from None
    report = {
        **result.to_dict(),
        "tokens_per_second": result.tokens_generated / result.seconds if result.seconds else 0.0,
        "attn_implementation": attention_implementation(model),
        "model": model_identity(model),
        "budget": result.budget,  # the K it ran at: raised for a prompt past it (CacheSpec.prompt_budget)
        "interval": spec.interval,
        "rank_every": spec.rank_every,
        "policy": policy.config(),
        "bands": None if spec.bands is None else dataclasses.asdict(spec.bands),
        "load_seconds": load_seconds,
        "threads": threads,
        "dtype": str(dtype).removeprefix("torch."),
        "dtype_choice": dtype_note,
    }
    del report["token_ids"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print()
        print(_summary(report), file=sys.stderr)
    return 0


class _Streamer:
    """Prints the decoded text as it grows (decoding the whole sequence keeps multi-byte pieces right)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def push(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text


class _PrefillBar:
    """A progress bar on stderr for a prompt long enough to be prefilled in chunks (issue #12)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def update(self, row: int, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


def _summary(r: dict[str, Any]) -> str:
    return (
        f"[epikv] policy={r['policy']['name']} budget={r['budget']} interval={r['interval']} "
        f"attn={r['attn_implementation']} | prompt {r['prompt_tokens']} + generated {r['tokens_generated']} "
        f"tokens ({r['finish_reason']}) | cache peak {r['peak_cache_tokens']}, "
        f"final {r['final_cache_tokens']}, "
        f"evicted {r['evictions']} | {r['tokens_per_second']:.1f} tok/s"
    )


def _add_policies(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policies", help="list the eviction policies, their defaults and needs")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--models", action="store_true", help="list the model architectures instead, and what was proven"
    )
    p.set_defaults(func=cmd_policies)


def cmd_policies(args: argparse.Namespace) -> int:
    if args.models:
        return _print_models(args.json)
    rows = [policy_class(name).describe() for name in policy_names()]
    for row in rows:
        row["aliases"] = sorted(alias for alias, target in ALIASES.items() if target == row["name"])
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| policy | needs | defaults | source |\n|---|---|---|---|")
    for row in rows:
        needs = ", ".join(k for k, v in row["needs"].items() if v) or "-"
        defaults = ", ".join(f"{k}={v}" for k, v in row["defaults"].items())
        name = " = ".join(f"`{n}`" for n in [*row["aliases"], row["name"]])
        print(f"| {name} | {needs} | {defaults} | {row['source'] or '-'} |")
    return 0


def _print_models(as_json: bool) -> int:
    from epikv.archs import ARCHITECTURES, HYBRID_PROVEN, NOT_YET, PROVEN

    supported = [
        {
            "model_type": name,
            "query_path": spec.query_path(),
            "sliding_windows": spec.hybrid,
            "examples": spec.examples,
            "proven": list(PROVEN) + (list(HYBRID_PROVEN) if spec.hybrid else []),
        }
        for name, spec in sorted(ARCHITECTURES.items())
    ]
    refused = [{"model_type": name, "reason": reason} for name, reason in sorted(NOT_YET.items())]
    if as_json:
        print(json.dumps({"supported": supported, "not_yet": refused}, indent=2))
        return 0
    print("| model type | query path (Seg-Q, attention baselines) | sliding-window layers | e.g. |")
    print("|---|---|---|---|")
    for row in supported:
        windows = "kept as a ring of W, never evicted" if row["sliding_windows"] else "refused"
        print(f"| `{row['model_type']}` | {row['query_path']} | {windows} | {row['examples']} |")
    print("\nProven for each on a tiny random-weight model from its config class:")
    print("\n".join(f"- {claim}" for claim in PROVEN))
    print("\nAnd for those that keep sliding-window layers (tiny configs with a window of 6 in two layers):")
    print("\n".join(f"- {claim}" for claim in HYBRID_PROVEN))
    print("\nNot yet (refused with the reason):")
    print("\n".join(f"- `{row['model_type']}`: {row['reason']}" for row in refused))
    return 0


DESCRIPTION = "Keep an LLM's KV cache inside a token budget by evicting tokens (EpiKV and baselines)."


def build_parser() -> argparse.ArgumentParser:
    from epikv import __version__

    parser = argparse.ArgumentParser(prog="epikv", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"epikv {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _add_generate(sub)
    _add_policies(sub)
    for module_name, adders in _EXTENSIONS:
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        for adder in adders:
            getattr(module, adder)(sub)
    return parser


# Subsystems add their own subcommands.
_EXTENSIONS: list[tuple[str, list[str]]] = [
    ("epikv.eval.cli", ["add_eval_parser", "add_report_parser"]),
    ("epikv.bench.cli", ["add_bench_parser"]),
    ("epikv.calibrate.cli", ["add_calibrate_parser"]),
    ("epikv.profile_cli", ["add_profile_parser"]),
    ("epikv.serve.cli", ["add_serve_parser"]),
]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:  # the hub's retry chatter (20 lines offline) before our one line; -v shows it
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    return run_command(args.func, args)  # one line and status 2 for a user's mistake (epikv.errors)


if __name__ == "__main__":
    raise SystemExit(main())
