"""Side by side with NVIDIA kvpress's decoding-time compression: same model, prompt, budget, interval.

kvpress 0.5.5 pins transformers < 5.3, so it lives in its own virtual environment, which
:func:`ensure_peer_env` creates (``python -m venv`` + ``pip install kvpress==0.5.5 torch==<ours>``)
and reuses. Each method runs in a fresh process so peak memory is its own: kvpress presses through
the self-contained :mod:`epikv.bench.peer.kvpress_runner` script, our policies through this module's
worker (``python -m epikv.bench.peer.study --worker ...``). Both sides decode the same prompt ids for the
same number of greedy tokens (EOS ignored) from the same model folder on the same threads.

Compared: decode tokens/s, peak resident memory above the loaded model, the cache's final size,
and whether the kept set is what the method defines (kvpress: StreamingLLM and Knorm at layer 0,
see the runner; ours: ``streaming`` from the cache's true positions). Pairs of the same method:
``streaming``/StreamingLLM, ``h2o``/ObservedAttention (H2O-like), ``tova``/TOVA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epikv.bench.shared import documents, figures, machine, model_loading, prompt_loading

PAIRS = {"streaming": "streaming", "h2o": "observed", "tova": "tova"}
RUNNER = Path(__file__).with_name("kvpress_runner.py")


@dataclass(frozen=True)
class PeerConfig:
    """One peer comparison; ``venv`` None = ``<epikv cache>/peer/kvpress-<version>``."""

    model: str | None = None
    budget: int = 256
    interval: int = 64
    tokens: int = 512
    ours: tuple[str, ...] = ("streaming", "h2o", "tova", "epikv", "epikv-flat")
    presses: tuple[str, ...] = ("streaming", "knorm", "tova", "observed")
    prompt_source: str = "gsm8k"
    prompt_index: int = 1
    chat: bool = True
    kvpress_version: str = "0.5.5"
    venv: str | None = None
    torch_spec: str | None = None
    threads: int | None = 1
    n_sink: int = 4
    eager_policies: tuple[str, ...] = ("h2o",)  # read eager weights, as kvpress's ObservedAttention must
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.budget < 1 or self.interval < 1 or self.tokens < 1:
            raise ValueError("budget, interval and tokens must be positive")


# About two minutes on 2 cores once the kvpress environment exists (its first setup takes longer).
QUICK = PeerConfig(
    budget=96,
    interval=16,
    tokens=64,
    ours=("streaming", "h2o", "epikv"),
    presses=("streaming", "knorm", "observed"),
)


# --------------------------------------------------------------------------- the other environment


def peer_venv_dir(config: PeerConfig) -> Path:
    from epikv.models import model_cache_dir

    return (
        Path(config.venv) if config.venv else model_cache_dir() / "peer" / f"kvpress-{config.kvpress_version}"
    )


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed ({proc.returncode}): {proc.stderr[-800:]}")
    return proc


def peer_versions(python: Path) -> dict[str, str] | None:
    code = (
        "import json, importlib.metadata as m; "
        "print(json.dumps({p: m.version(p) for p in ('kvpress', 'transformers', 'torch')}))"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 and proc.stdout else None


def ensure_peer_env(config: PeerConfig) -> tuple[Path, dict[str, str]]:
    """The kvpress environment's python and its versions, creating the environment if needed."""
    venv = peer_venv_dir(config)
    python = venv / "bin" / "python"
    if python.exists() and (versions := peer_versions(python)):
        return python, versions
    spec = f"kvpress=={config.kvpress_version}"
    with tempfile.TemporaryDirectory() as scratch:  # fail early and clearly if the index lacks it
        _run([sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", scratch], 600)
    _run([sys.executable, "-m", "venv", str(venv)], 600)
    torch_spec = config.torch_spec or f"torch=={torch.__version__}"
    _run([str(python), "-m", "pip", "install", "--quiet", torch_spec, spec], 3000)
    versions = peer_versions(python)
    if versions is None:
        raise RuntimeError(f"kvpress was installed in {venv} but does not import")
    return python, versions


# --------------------------------------------------------------------------- inputs both sides share


def model_folder(config: PeerConfig, model: torch.nn.Module | None, scratch: Path) -> Path:
    """A folder both transformers versions can load: the embedded model's converted copy, a local
    folder, or the given/random model saved into ``scratch``."""
    from epikv.models import embedded_cache_folder, is_embedded_name

    if model is None and config.model is not None and config.model.startswith("random:"):
        model, _ = model_loading.load_bench_model(config.model)
    if model is not None:
        model.save_pretrained(scratch / "model")
        return scratch / "model"
    if is_embedded_name(config.model):
        model_loading.load_bench_model(None)  # converts the GGUF once if needed
        return embedded_cache_folder()
    return Path(config.model)


def prompt_ids(config: PeerConfig, tokenizer: Any) -> list[int]:
    text = prompt_loading.load_prompts(config.prompt_source, 1, config.prompt_index)[0]
    return prompt_loading.prompt_token_ids(tokenizer, text, config.chat)


# --------------------------------------------------------------------------- running both sides


def _json_line(proc: subprocess.CompletedProcess, what: str) -> dict[str, Any]:
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": f"{what} printed no result (exit {proc.returncode}): {proc.stderr[-600:]}"}


def run_side(cmd: list[str], what: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, **machine.QUIET_MALLOC)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"{what} timed out after {timeout:.0f} s"}
    return _json_line(proc, what)


def common_args(config: PeerConfig, folder: Path, ids_file: Path) -> list[str]:
    args = ["--model", str(folder), "--ids", str(ids_file), "--budget", str(config.budget)]
    args += [
        "--interval",
        str(config.interval),
        "--tokens",
        str(config.tokens),
        "--n-sink",
        str(config.n_sink),
    ]
    return args + (["--threads", str(config.threads)] if config.threads else [])


SideRunner = Callable[[list[str], str, float], dict[str, Any]]


def run_peer(
    config: PeerConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    runner: SideRunner | None = None,
    reporter: documents.Reporter | None = None,
) -> dict[str, Any]:
    """Set up kvpress, then run every press and every policy of ``config``; the peer document.

    ``runner(cmd, what, timeout)`` runs one side's command (default: a fresh process)."""
    run_side_ = runner or run_side
    reporter = reporter or documents.Reporter()
    from epikv.bench.speed.study import available_policies

    python, versions = ensure_peer_env(config) if config.presses else (None, {})
    ours, missing = available_policies(config.ours)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        folder = model_folder(config, model, scratch)
        if tokenizer is None:
            tokenizer = model_loading.load_bench_model(config.model)[1]
        ids_file = scratch / "ids.json"
        ids_file.write_text(json.dumps(prompt_ids(config, tokenizer)))
        args = common_args(config, folder, ids_file)
        worker = [sys.executable, "-m", "epikv.bench.peer.study", "--worker"]
        sides = [("kvpress", p, [str(python), str(RUNNER), "--press", p, *args]) for p in config.presses]
        sides += [
            ("epikv", p, [*worker, "--policy", p, "--attention", _attention(config, p), *args]) for p in ours
        ]
        rows = []
        with reporter.bar(len(sides), "peer", unit="method") as bar:
            for side, method, command in sides:
                bar.set_postfix_str(f"{side} {method}")
                done = run_side_(command, f"{side} {method}", config.timeout_s)
                row = {"side": side, "method": method, **done}
                if "cache_spec" in row:  # our worker's spec, with its bands: into the result's config
                    reporter.uses(row.pop("cache_spec"))
                rows.append(row)
                bar.update()
    results = {
        "model": str(config.model or "smollm2-135m"),
        "peer_versions": versions,
        "missing_policies": missing,
        "rows": rows,
        "comparison": compare(rows),
    }
    return documents.make_document("peer", config, results, specs=reporter.specs)


def _attention(config: PeerConfig, policy: str) -> str:
    return "eager" if policy in config.eager_policies else "recompute"


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Same-method pairs (ours / kvpress) and every policy against the fastest press."""
    speed = {(r["side"], r["method"]): r.get("tokens_per_s") for r in rows}
    memory = {(r["side"], r["method"]): r.get("peak_bytes") for r in rows}
    pairs = {}
    for ours, theirs in PAIRS.items():
        a, b = speed.get(("epikv", ours)), speed.get(("kvpress", theirs))
        if a and b:
            ma, mb = memory.get(("epikv", ours)), memory.get(("kvpress", theirs))
            pairs[f"{ours}/{theirs}"] = {
                "tokens_per_s_ratio": a / b,
                "peak_ratio": ma / mb if ma and mb else None,
            }
    presses = [v for (side, _), v in speed.items() if side == "kvpress" and v]
    fastest = max(presses) if presses else None
    versus = {m: v / fastest for (side, m), v in speed.items() if side == "epikv" and v and fastest}
    return {"pairs": pairs, "vs_fastest_press": versus}


# --------------------------------------------------------------------------- our side's worker


def expected_streaming(prompt: int, fed: int, budget: int, interval: int, n_sink: int) -> list[int]:
    """Positions our ``streaming`` keeps: sinks + most recent, compacting when over budget and at
    least ``interval`` steps after the last compaction (the cache's schedule; prefill included)."""
    held, since = list(range(prompt)), interval
    if len(held) > budget:
        held, since = held[:n_sink] + held[len(held) - (budget - n_sink) :], 0
    for step in range(fed):
        held.append(prompt + step)
        since += 1
        if len(held) > budget and since >= interval:
            held, since = held[:n_sink] + held[len(held) - (budget - n_sink) :], 0
    return held


def worker_main(argv: list[str]) -> int:
    """Decode under one of our policies from a model folder; print one JSON line."""
    from transformers import AutoModelForCausalLM

    from epikv.bench.speed.study import timed_decode

    parser = argparse.ArgumentParser(prog="python -m epikv.bench.peer.study --worker")
    for flag in ("--model", "--ids", "--policy"):
        parser.add_argument(flag, required=True)
    for flag in ("--budget", "--interval", "--tokens"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention", default="recompute")
    args = parser.parse_args(argv)
    machine.set_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    ids = torch.tensor([json.loads(Path(args.ids).read_text())])
    model_loading.page_in(model)
    machine.reset_peak_rss()  # the heap trimmed first, then the baseline
    base = machine.current_rss()

    spec: dict[str, Any] = {}

    def positions(cache: Any) -> list[int]:
        spec.update(documents.spec_record(cache.spec))
        held = cache.layers[0].positions[0, 0]
        return sorted(int(p) for p in held.tolist() if p >= 0)

    trace = timed_decode(
        model, ids, args.policy, args.budget, args.tokens, args.interval, args.attention, positions
    )
    report: dict[str, Any] = {
        "tokens_per_s": len(trace.step_s) / sum(trace.step_s),
        "prefill_s": trace.prefill_s,
        "peak_bytes": machine.peak_rss() - base,
        "final_cache_tokens": [len(trace.extra)],
        "peak_cache_tokens": trace.peak_cache_tokens,
        "cache_spec": spec,
    }
    if args.policy == "streaming":
        want = expected_streaming(ids.shape[1], args.tokens, args.budget, args.interval, args.n_sink)
        report["kept_set"] = {"checked": True, "all_match": trace.extra == want}
    else:
        report["kept_set"] = {"checked": False, "why": "score-defined set; the cache's own tests check top-k"}
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


# --------------------------------------------------------------------------- figure


def plot_peer(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Tokens/s and peak memory per method, kvpress and epikv side by side."""
    data = documents.read_result(json_path, "peer")
    rows = [r for r in data["results"]["rows"] if "tokens_per_s" in r]
    labels = [f"{r['side']}\n{r['method']}" for r in rows]
    colours = ["C1" if r["side"] == "kvpress" else "C0" for r in rows]
    figure, (left, right) = figures.new_figure(width=10.0, height=4.2, ncols=2)
    left.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colours)
    right.bar(range(len(rows)), [r["peak_bytes"] / 2**20 for r in rows], color=colours)
    for axes, ylabel in ((left, "decode tokens/s"), (right, "peak memory above model (MiB)")):
        axes.set_xticks(range(len(rows)), labels, fontsize=6, rotation=45)
        axes.set_ylabel(ylabel)
    cfg = data["config"]
    left.set_title(f"K={cfg['budget']}, tau={cfg['interval']}, {cfg['tokens']} tokens", fontsize=9)
    return figures.save_figure(figure, png or figures.png_path(json_path))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker"]:
        raise SystemExit(
            "usage: python -m epikv.bench.peer.study --worker ... (use `epikv bench peer` instead)"
        )
    raise SystemExit(worker_main(sys.argv[2:]))
