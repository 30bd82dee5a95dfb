"""One prepared command for a lent accelerator: memory to the OOM boundary and decode throughput.

No weights and no network are needed: each model is randomly initialised from its architecture
(the DeepSeek R1-Distill-Qwen-1.5B and R1-Distill-Llama-8B shapes below), in bfloat16. Memory and
speed do not depend on the weights' values; accuracy does, and is not measured here.

    python scripts/gpu_bench.py --out /tmp/g && tar czf "$OUT/g.tar.gz" -C /tmp g  # GPU, < 9 min
    python scripts/gpu_bench.py --device cpu --tiny --out /tmp/g  # the CPU path, in seconds

(the device tool returns at most 8 files: hence the tarball.)

Runs, in priority order:
1. memory of one forward pass vs length for every model (three paths, ``--cap-gb`` emulates an
   80 GB card as in the paper's Fig. 1), to each path's out-of-memory boundary;
2. decode speed for full / epikv / h2o (eager attention) at each budget K (every model at the
   smallest K first), forced K + ``--extra`` tokens; a run starts only if the time left before
   ``--deadline-s`` covers its estimate (``--step-ms`` per decode step: 40 ms measured on an H200);
3. after each speed run, ``--profile-steps`` steps of each policy under torch's profiler, after
   each of ``--profile-at`` decode steps: where a step's host and device time go
   (``OUT/<model>/K<k>/profile.json``). On an H200 a ``full`` step took 62 ms on both models.
Every result is written as soon as it exists (``OUT/<model>/memory.json``,
``OUT/<model>/K<k>/speed.json``, with PNGs), and ``OUT/summary.json`` lists what ran and what was
skipped for time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from epikv.bench.memory.study import MemoryConfig, plot_memory, run_memory
from epikv.bench.shared import documents, machine, model_loading, prompt_loading
from epikv.bench.speed.study import PolicyDecode, SpeedConfig, budget_of, plot_speed, run_speed

# Public config.json shapes; rope and norm details left at transformers' defaults (no weights).
CONFIGS = {
    "r1-distill-qwen-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=131072,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        use_sliding_window=False,
    ),
    "r1-distill-llama-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}
TINY = {"tiny-llama": dict(model_loading.RANDOM_PRESETS["tiny-llama"])}
FULL_SIZES = dict(
    budgets="1024,2048,4096", extra=1024, min_length=1024, max_length=131072, step_ms=40.0, profile_at="64"
)
TINY_SIZES = dict(budgets="128", extra=32, min_length=64, max_length=256, step_ms=5.0, profile_at="8,24")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 4-layer model and small sizes (tests the CPU path)")
    p.add_argument("--models", default=None, help="comma-separated names from CONFIGS (default: all)")
    p.add_argument("--budgets", default=None, help="comma-separated K (default 1024,2048,4096)")
    p.add_argument("--extra", type=int, default=None, help="decode steps after the cache reaches K (1024)")
    p.add_argument("--policies", default="full,epikv,h2o")
    p.add_argument("--min-length", type=int, default=None, help="first memory length (1024)")
    p.add_argument("--max-length", type=int, default=None, help="last memory length (131072)")
    p.add_argument("--cap-gb", type=float, default=80.0, help="emulated accelerator size for memory")
    p.add_argument("--deadline-s", type=float, default=450.0, help="stop starting runs after this")
    p.add_argument("--step-ms", type=float, default=None, help="assumed decode step time (40 ms)")
    p.add_argument("--profile-steps", type=int, default=8, help="steps profiled per policy and K (0: none)")
    p.add_argument("--profile-at", default=None, help="decode steps before each profiled window (64)")
    args = p.parse_args(argv)
    sizes = TINY_SIZES if args.tiny else FULL_SIZES
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.profile_at = sorted(int(m) for m in str(args.profile_at).split(","))
    if args.tiny:
        args.cap_gb = None
    return args


def build(name: str, spec: dict, device: str) -> tuple[torch.nn.Module, model_loading.ByteTokenizer]:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = model_loading.random_model({**spec, "name": name}, dtype=dtype, device=device)
    return model, model_loading.ByteTokenizer(model.config.vocab_size)


def _threads(args: argparse.Namespace) -> int | None:
    return 1 if args.device == "cpu" else None  # two threads per op thrash a shared CPU


def _free(args: argparse.Namespace) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def memory_phase(name: str, spec: dict, args: argparse.Namespace) -> None:
    """One forward pass per (path, length) up to each path's OOM boundary, in this process."""
    model, _ = build(name, spec, args.device)
    memory = MemoryConfig(
        model=f"random:{name}",
        min_length=args.min_length,
        max_length=args.max_length,
        cap_gb=args.cap_gb,
        device=args.device,
        dtype=str(model.dtype).split(".")[-1],
        threads=_threads(args),
    )
    plot_memory(documents.write_result(run_memory(memory, model=model), Path(args.out) / name))
    del model
    _free(args)


def speed_run(
    name: str,
    model: torch.nn.Module,
    tokenizer: model_loading.ByteTokenizer,
    budget: int,
    args: argparse.Namespace,
) -> None:
    config = SpeedConfig(
        model=f"random:{name}",
        policies=tuple(args.policies.split(",")),
        budget=budget,
        tokens=budget + args.extra,
        repeats=1,
        device=args.device,
        threads=_threads(args),
        bin_size=128,
        chat=False,
    )
    out = Path(args.out) / name / f"K{budget}"
    plot_speed(documents.write_result(run_speed(config, model, tokenizer), out))
    if args.profile_steps:
        profile_run(config, model, tokenizer, args, out / "profile.json")


def profile_run(
    config: SpeedConfig,
    model: torch.nn.Module,
    tokenizer: model_loading.ByteTokenizer,
    args: argparse.Namespace,
    path: Path,
) -> None:
    """Where a decode step's time goes, per policy: ``--profile-steps`` steps under torch's profiler
    after each of ``--profile-at`` decode steps (the speed run's prompt and K), the ops with the
    most self time on the host and on the device, and the runtime calls that wait or allocate."""
    from torch.profiler import ProfilerActivity, profile

    text = prompt_loading.load_prompts(config.prompt_source, 1, config.prompt_index)[0]
    ids = prompt_loading.encode_prompt(tokenizer, text, False).to(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    marks = args.profile_at
    out: dict = {"budget": config.budget, "steps": args.profile_steps, "at": marks, "policies": {}}
    for policy in config.policies:
        run = PolicyDecode(model, ids, policy, budget_of(config, policy), None, "eager", marks[-1] + 64)
        run.prefill()
        done, windows = 0, []
        for mark in marks:
            run.advance(mark - done)
            with profile(activities=activities) as prof:
                run.advance(args.profile_steps)
            done = mark + args.profile_steps
            step_ms = [1000 * t for t in run.trace.step_s[-args.profile_steps :]]
            windows.append({"at": mark, "slots": run.trace.slots[-1], "step_ms": step_ms, **_top(prof)})
        out["policies"][policy] = windows
        del run
        _free(args)
    path.write_text(json.dumps(out, indent=1) + "\n")


def _top(prof: object, n: int = 12) -> dict:
    rows = prof.key_averages()  # type: ignore[attr-defined]
    runtime = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")

    def table(key: str) -> list:
        ranked = sorted(rows, key=lambda r: -getattr(r, key, 0.0))[:n]
        return [[r.key, r.count, round(getattr(r, key) / 1000, 3)] for r in ranked if getattr(r, key, 0.0)]

    return {
        "host_ms": table("self_cpu_time_total"),
        "device_ms": table("self_device_time_total"),
        "runtime_calls": {r.key: r.count for r in rows if r.key in runtime},
        "ops": sum(r.count for r in rows if r.key.startswith("aten::")),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    configs = TINY if args.tiny else CONFIGS
    names = args.models.split(",") if args.models else list(configs)
    log: list = []
    summary_path = Path(args.out, "summary.json")
    summary_path.parent.mkdir(parents=True, exist_ok=True)

    def record(entry: dict) -> None:  # rewritten after every run, so a killed command still says what ran
        log.append({**entry, "at_s": round(time.perf_counter() - started, 1)})
        summary = {"machine": machine.machine_info(args.device), "args": vars(args), "runs": log}
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    for name in names:
        memory_phase(name, configs[name], args)
        record({"model": name, "run": "memory"})
    built: tuple[str, torch.nn.Module, model_loading.ByteTokenizer] | None = None
    for budget in (int(k) for k in args.budgets.split(",")):
        for name in names:  # every model at the smallest K first: the deadline cuts the largest K
            steps = budget + args.extra
            if args.profile_steps:
                steps += args.profile_at[-1] + args.profile_steps
            estimate = len(args.policies.split(",")) * steps * args.step_ms / 1000
            if time.perf_counter() - started + estimate > args.deadline_s:
                record({"model": name, "run": f"speed K={budget}", "skipped": f"needs ~{estimate:.0f} s"})
                continue
            if built is None or built[0] != name:
                built = None
                _free(args)
                built = (name, *build(name, configs[name], args.device))
            speed_run(name, built[1], built[2], budget, args)
            record({"model": name, "run": f"speed K={budget}" + (" + profile" if args.profile_steps else "")})
    print(json.dumps(log, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
