"""Peak memory of one forward pass over L tokens (paper Fig. 1), and where each path runs out.

Three paths over the same random token ids (memory does not depend on the text):

* ``attention_outputs``: eager attention with ``output_attentions=True``, what attention-scored
  eviction needs from a stock model (every layer's L x L weights are returned);
* ``sdpa``: the model's fused attention with a plain growing cache;
* ``epikv_capture``: SDPA with ``epikv.attach(model, "epikv-flat", budget=<huge>)`` active, so
  the band layers' hidden states are captured on the way (nothing is evicted).

Every forward keeps its KV cache and only the last position's logits. On the CPU each (path, L)
runs in its own process (:mod:`epikv.bench.memory.worker`) whose address space is capped a fixed
amount above the loaded model, so running out of memory is an exception that the worker reports,
not a crash of the benchmark; the figure is resident memory (peak RSS minus RSS after loading). On
CUDA the points run in this process, peak = ``torch.cuda.max_memory_allocated``, and an
out-of-memory error is caught. A path stops at its first failure; longer lengths are "skipped".
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epikv.bench.shared import documents, figures, machine, model_loading

PATHS = ("attention_outputs", "sdpa", "epikv_capture")
GIB = 1 << 30
PointRunner = Callable[[str, int], dict[str, Any]]


@dataclass(frozen=True)
class MemoryConfig:
    """Lengths double from ``min_length`` to ``max_length``. ``cap_gb``: memory allowed above the
    loaded model (CPU, as an address-space limit) or the emulated accelerator size (CUDA)."""

    model: str | None = None
    min_length: int = 512
    max_length: int = 8192
    cap_gb: float | None = 4.0
    paths: tuple[str, ...] = PATHS
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    timeout_s: float = 900.0
    capture_policy: str = "epikv-flat"

    def __post_init__(self) -> None:
        if not 0 < self.min_length <= self.max_length:
            raise ValueError(f"need 0 < min_length <= max_length, got {self.min_length}, {self.max_length}")
        unknown = sorted(set(self.paths) - set(PATHS))
        if unknown:
            raise ValueError(f"unknown memory path(s) {unknown}; known: {list(PATHS)}")
        if self.cap_gb is not None and self.cap_gb <= 0:
            raise ValueError(f"cap_gb must be positive, got {self.cap_gb}")

    @property
    def lengths(self) -> list[int]:
        out, length = [], self.min_length
        while length <= self.max_length:
            out.append(length)
            length *= 2
        return out


# About two minutes on 2 cores: the embedded model, 256..2048 tokens, 1 GB above the model.
QUICK = MemoryConfig(min_length=256, max_length=2048, cap_gb=1.0)


# --------------------------------------------------------------------------- one point


def forward_once(model: torch.nn.Module, path: str, input_ids: torch.Tensor, capture_policy: Any) -> Any:
    """One prefill forward along ``path``; returns the outputs so they stay alive until measured."""
    from epikv import attach
    from epikv.integration.compat import cache_kwargs

    with torch.no_grad():
        if path == "attention_outputs":
            previous = model.config._attn_implementation
            model.set_attn_implementation("eager")
            try:
                return model(input_ids=input_ids, use_cache=True, output_attentions=True, logits_to_keep=1)
            finally:
                model.set_attn_implementation(previous)
        if path == "sdpa":
            return model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        with attach(model, capture_policy, budget=1 << 30) as cache:  # huge: capture, never evict
            return model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))


def is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("allocate" in text or "out of memory" in text)


def measure_point(
    model: torch.nn.Module, path: str, length: int, device: str, capture_policy: str = "epikv-flat"
) -> dict[str, Any]:
    """Peak memory of one forward of ``length`` tokens along ``path`` in this process."""
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator).to(device)
    cuda = torch.device(device).type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base, source = torch.cuda.memory_allocated(), "cuda.max_memory_allocated"
    else:
        source = "VmHWM" if machine.reset_peak_rss() else "ru_maxrss"  # the heap trimmed first
        base = machine.current_rss()
    point: dict[str, Any] = {"path": path, "length": length, "status": "ok", "source": source}
    spec: Any = capture_policy
    if path == "epikv_capture":  # the spec the capture runs, with its bands, for the result's config
        from epikv.integration import build_spec

        spec = build_spec(model, capture_policy, 1 << 30)
        point["cache_spec"] = documents.spec_record(spec)
    started = time.perf_counter()
    try:
        out = forward_once(model, path, ids, spec)
        machine.synchronizer(device)()
        peak = torch.cuda.max_memory_allocated() if cuda else machine.peak_rss()
        del out
    except Exception as err:
        if not is_oom(err):
            raise
        point.update(status="oom", error=str(err).splitlines()[0][:200])
        peak = None
    point["seconds"] = time.perf_counter() - started
    point["baseline_bytes"] = base
    point["peak_total_bytes"] = peak
    point["peak_bytes"] = None if peak is None else peak - base
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return point


# --------------------------------------------------------------------------- runners


def subprocess_runner(config: MemoryConfig) -> PointRunner:
    """Each point in a fresh ``python -m epikv.bench.memory.worker`` under the address-space cap."""
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, **machine.QUIET_MALLOC)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)

    def run(path: str, length: int) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "epikv.bench.memory.worker", "--path", path, "--length", str(length)]
        cmd += ["--device", config.device, "--dtype", config.dtype, "--capture-policy", config.capture_policy]
        if config.model is not None:
            cmd += ["--model", config.model]
        if config.cap_gb is not None:
            cmd += ["--cap-gb", str(config.cap_gb)]
        if config.threads is not None:
            cmd += ["--threads", str(config.threads)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=config.timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {"path": path, "length": length, "status": "timeout", "seconds": config.timeout_s}
        return parse_worker_output(path, length, proc.returncode, proc.stdout, proc.stderr)

    return run


def parse_worker_output(path: str, length: int, code: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The worker's JSON line, or a failed point that says how the worker died."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    status = "killed" if code < 0 else "crashed"  # SIGKILL from the kernel's OOM killer reads as killed
    return {"path": path, "length": length, "status": status, "returncode": code, "error": stderr[-400:]}


def inprocess_runner(model: torch.nn.Module, config: MemoryConfig) -> PointRunner:
    """Points in this process (CUDA, or a model object handed in); a cap emulates a smaller GPU."""
    if torch.device(config.device).type == "cuda" and config.cap_gb is not None:
        total = torch.cuda.get_device_properties(torch.device(config.device)).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.cap_gb * GIB / total))

    def run(path: str, length: int) -> dict[str, Any]:
        return measure_point(model, path, length, config.device, config.capture_policy)

    return run


def run_memory(
    config: MemoryConfig,
    model: torch.nn.Module | None = None,
    runner: PointRunner | None = None,
    reporter: documents.Reporter | None = None,
) -> dict[str, Any]:
    """Measure every (path, length) up to each path's first failure; returns the memory document."""
    reporter = reporter or documents.Reporter()
    machine.set_threads(config.threads)
    if runner is None:
        in_process = model is not None or torch.device(config.device).type == "cuda"
        if in_process and model is None:
            model, _ = model_loading.load_bench_model(config.model, config.device, config.dtype)
        runner = inprocess_runner(model, config) if in_process else subprocess_runner(config)
    points: list[dict[str, Any]] = []
    with reporter.bar(len(config.paths) * len(config.lengths), "memory", unit="point") as bar:
        for path in config.paths:
            failed = False
            for length in config.lengths:
                bar.set_postfix_str(f"{path} L={length}")
                if failed:
                    points.append({"path": path, "length": length, "status": "skipped"})
                    bar.update()
                    continue
                point = runner(path, length)
                if "cache_spec" in point:
                    reporter.uses(point.pop("cache_spec"))
                points.append(point)
                failed = point["status"] != "ok"
                bar.update()
    name = (
        model_loading.model_name(model) if model is not None else next((p.get("model") for p in points), None)
    )
    results = {"model": name, "points": points, "summary": summarize_memory(points, config)}
    return documents.make_document("memory", config, results, config.device, reporter.specs)


# --------------------------------------------------------------------------- summary and figure


def summarize_memory(points: list[dict[str, Any]], config: MemoryConfig) -> dict[str, Any]:
    """Largest feasible length per path, feasible-context ratios and the capture overhead."""
    per_path: dict[str, dict[str, Any]] = {}
    for path in config.paths:
        mine = [p for p in points if p["path"] == path]
        ok = [p["length"] for p in mine if p["status"] == "ok"]
        failure = next((p for p in mine if p["status"] not in ("ok", "skipped")), None)
        per_path[path] = {
            "max_ok_length": max(ok) if ok else None,
            "first_failure": None
            if failure is None
            else {"length": failure["length"], "status": failure["status"]},
        }
    ratios = {}
    base = per_path.get("attention_outputs", {})
    for path in ("sdpa", "epikv_capture"):
        if path in per_path and base.get("max_ok_length"):
            top = per_path[path]["max_ok_length"] or 0
            ratios[f"{path}/attention_outputs"] = {
                "ratio": top / base["max_ok_length"],
                # the numerator never failed: the true ratio is at least this (max_length bound)
                "lower_bound": per_path[path]["first_failure"] is None,
            }
    return {"paths": per_path, "feasible_ratio": ratios, "capture_overhead": capture_overhead(points)}


def capture_overhead(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(epikv_capture - sdpa) / sdpa in percent at each length both reached: resident and total."""
    ok = {(p["path"], p["length"]): p for p in points if p["status"] == "ok"}
    rows = []
    for (path, length), cap in sorted(ok.items(), key=lambda item: item[0][1]):
        plain = ok.get(("sdpa", length))
        if path != "epikv_capture" or plain is None or not plain["peak_bytes"]:
            continue
        rows.append(
            {
                "length": length,
                "resident_pct": 100 * (cap["peak_bytes"] - plain["peak_bytes"]) / plain["peak_bytes"],
                "total_pct": 100
                * (cap["peak_total_bytes"] - plain["peak_total_bytes"])
                / plain["peak_total_bytes"],
            }
        )
    return rows


def plot_memory(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Peak forward memory vs length per path; the first failure of each path marked with an x."""
    data = documents.read_result(json_path, "memory")
    results = data["results"]
    figure, (axes,) = figures.new_figure()
    for index, path in enumerate(data["config"]["paths"]):
        mine = [p for p in results["points"] if p["path"] == path]
        ok = [p for p in mine if p["status"] == "ok"]
        colour = f"C{index}"
        axes.plot(
            [p["length"] for p in ok], [p["peak_bytes"] / 2**20 for p in ok], "o-", color=colour, label=path
        )
        failure = results["summary"]["paths"][path]["first_failure"]
        if failure is not None and ok:
            axes.plot([failure["length"]], [ok[-1]["peak_bytes"] / 2**20], "x", color=colour, markersize=10)
            axes.annotate(failure["status"], (failure["length"], ok[-1]["peak_bytes"] / 2**20), fontsize=7)
    axes.set_xscale("log", base=2)
    if any(p["status"] == "ok" for p in results["points"]):
        axes.set_yscale("log")
    axes.set_xlabel("tokens in one forward pass")
    axes.set_ylabel("peak memory above loaded model (MiB)")
    ratios = results["summary"]["feasible_ratio"]
    text = ", ".join(
        f"{k.split('/')[0]} {'>=' if v['lower_bound'] else ''}{v['ratio']:g}x" for k, v in ratios.items()
    )
    axes.set_title(
        f"{results['model']} ({data['config']['device']}); feasible context vs eager: {text}", fontsize=8
    )
    axes.legend()
    return figures.save_figure(figure, png or figures.png_path(json_path))
