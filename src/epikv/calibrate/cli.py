"""``epikv calibrate``: find a model's EpiKV bands and write its profile into the run folder.

Parses arguments, builds a :class:`~epikv.calibrate.pipeline.CalibrationConfig`, runs it and prints
a short summary, with the command that would make the profile active (``epikv profile use``); the
work happens in :mod:`epikv.calibrate.pipeline`. It never changes the bands other runs use.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from epikv.calibrate.occlusion import FILLERS, LABELS, LabelSettings
from epikv.calibrate.pipeline import KEEP, CalibrationConfig
from epikv.calibrate.signals import SIGNALS
from epikv.calibrate.traces import DEFAULT_MARKERS
from epikv.outputs import check_output_dir
from epikv.profiles import BandProfile, weak_signal_warnings

# --quick: a smoke run that finishes in a few minutes on two CPU cores (see docs/calibration.md).
QUICK = {"limit": 8, "max_new_tokens": 256, "answer_tokens": 32, "bootstrap": 200}


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="find a model's EpiKV bands; writes a profile to --out",
        description="Find a model's EpiKV bands by occlusion and write its profile into --out. Other "
        "runs keep their bands until `epikv profile use OUT/<model>.json` makes it active.",
    )
    p.add_argument("--model", default=None, help="hub id or local path (default: embedded SmolLM2-135M)")
    source = p.add_mutually_exclusive_group(required=True)  # --reuse takes the dataset from --out
    source.add_argument("--dataset", help="gsm8k | math500 | aime2024 | amc2023 | FILE.jsonl | hf:...")
    source.add_argument(
        "--reuse",
        action="store_true",
        help="redo only the statistics and the choice from --out's traces and labels (no model runs); "
        "--label/--signal/--bootstrap/--seed apply, the rest comes from its config.json",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="problems (or given traces) to use (default 30; --quick: 8)"
    )
    p.add_argument("--offset", type=int, default=0, help="first problem")
    p.add_argument(
        "--traces", default=None, help="reuse a traces.jsonl from an earlier run instead of generating"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="trace length cap (default 384)")
    p.add_argument("--batch-size", type=int, default=8, help="problems generated together")
    p.add_argument("--keep", choices=KEEP, default="answered", help="traces to label (default: answered)")
    p.add_argument("--window", type=int, default=32, help="occlusion window in tokens")
    p.add_argument("--stride", type=int, default=16, help="occlusion stride in tokens")
    p.add_argument("--filler", choices=FILLERS, default="eos")
    p.add_argument("--label", choices=LABELS, default="loglik", help="label that chooses the bands")
    p.add_argument("--answer-tokens", type=int, default=None, help="answer cap for labels (default 64)")
    p.add_argument("--signal", choices=SIGNALS, default="zscore", help="signal that chooses the bands")
    p.add_argument("--rolling", type=int, default=64, help="rolling window of the mean / z-score")
    p.add_argument("--bootstrap", type=int, default=None, help="bootstrap resamples (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--marker", action="append", default=None, help="answer marker phrase (repeatable)")
    p.add_argument("--quick", action="store_true", help="small smoke run: " + json.dumps(QUICK))
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model precision (default float32)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    # Kept so that older command lines still run: calibration never installs its profile now.
    p.add_argument("--no-install", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", required=True, type=Path, help="run folder")
    p.set_defaults(func=cmd_calibrate)


def config_from_args(args: argparse.Namespace) -> CalibrationConfig:
    if args.reuse:
        return reuse_config(args)
    defaults = {"limit": 30, "max_new_tokens": 384, "answer_tokens": 64, "bootstrap": 1000}
    if args.quick:
        defaults.update(QUICK)

    def pick(name: str) -> int:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    labels = LabelSettings(
        args.label, args.window, args.stride, args.filler, pick("answer_tokens"), args.seed
    )
    config = CalibrationConfig(
        dataset=args.dataset, model=args.model, limit=pick("limit"), offset=args.offset,
        max_new_tokens=pick("max_new_tokens"), batch_size=args.batch_size, keep=args.keep, labels=labels,
        rolling=args.rolling, signal=args.signal, bootstrap=pick("bootstrap"), seed=args.seed,
        traces=args.traces, dtype=args.dtype,
    )  # fmt: skip
    if args.marker is not None:
        config = replace(config, markers=tuple(m for m in args.marker if m))
    return config


def reuse_config(args: argparse.Namespace) -> CalibrationConfig:
    """An earlier run's config with the analysis options of this command line."""
    from epikv.calibrate.pipeline import config_from_file

    base = config_from_file(args.out / "config.json")
    return replace(
        base,
        labels=replace(base.labels, kind=args.label),
        signal=args.signal,
        bootstrap=base.bootstrap if args.bootstrap is None else args.bootstrap,
        seed=args.seed,
    )


def cmd_calibrate(args: argparse.Namespace) -> int:
    from epikv.calibrate.pipeline import run_calibration

    check_output_dir(args.out)
    config = config_from_args(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = run_calibration(config, args.out, reuse=args.reuse, progress=not args.no_progress)
    c = result.rho["choice"]
    print(
        f"[epikv calibrate] {result.profile.model}: Band A = layer {c['band_a']} (ρ {c['rho_a']:+.3f}, "
        f"CI {c['ci_a'][0]:+.3f}..{c['ci_a'][1]:+.3f}), Band B = layer {c['band_b']} (ρ {c['rho_b']:+.3f}, "
        f"CI {c['ci_b'][0]:+.3f}..{c['ci_b'][1]:+.3f}) from {result.rho['n_problems']} problems, "
        f"{c['label']} labels, {c['signal']} signal; {time.perf_counter() - started:.0f} s"
    )
    for warning in c["warnings"]:
        print(f"[epikv calibrate] warning: {warning}", file=sys.stderr)
    print(f"[epikv calibrate] wrote {result.path}")
    print(activation_hint(result.profile, result.path))
    return 0


def activation_hint(profile: BandProfile, path: Path) -> str:
    """What to do with the profile: it is not in use until ``epikv profile use`` installs it."""
    hint = (
        f"[epikv calibrate] not in use: runs on {profile.model} keep their bands until "
        f"`epikv profile use {path}`"
    )
    if weak_signal_warnings(profile):
        hint += " (its warnings say the signal is weak: `profile use` refuses it without --force)"
    return hint


__all__ = ["DEFAULT_MARKERS", "add_calibrate_parser", "cmd_calibrate", "config_from_args"]
