"""Decode speed of every baseline (issue #3) against ``full`` and ``epikv`` in one process.

One chat prompt (a MATH-500 problem with the paper's system message), greedy, a fixed number of
forced tokens (ignore_eos), budget K, on the embedded model by default. Each attention-based
baseline runs with attention rows ``recompute``d beside SDPA and with the model in ``eager``
attention; attention-free policies run once. ``full`` and ``epikv`` run first and again last (the
ratios use the mean of the two, which also shows drift on a shared machine). Prints a markdown table
and writes the numbers and the configuration to a JSON file (default results/baselines_speed.json).

    .venv/bin/python scripts/bench_baselines.py [--tokens 1024] [--budget 256] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from epikv.generation import SamplingConfig, generate
from epikv.models import load_model, model_identity
from epikv.policies import policy_class

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
BASELINES = ["h2o", "h2o-head", "tova", "snapkv", "rkv", "raas", "thinkv", "lagkv", "keydiff"]
REFERENCES = ["full", "epikv"]
DATA = Path("/work/shared/data/math500.jsonl")


def chat_prompt(path: Path, index: int) -> tuple[str, list[dict[str, str]]]:
    row = json.loads(path.read_text().splitlines()[index])
    return row["id"], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["problem"]}]


def run_one(model: Any, tok: Any, prompt: Any, policy: str, mode: str, args: argparse.Namespace) -> dict:
    budget = args.budget if policy_class(policy).evicts else None
    sampling = SamplingConfig(max_new_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    (result,) = generate(model, tok, [prompt], policy, budget, sampling, attention=mode)
    seconds = time.perf_counter() - start
    return {
        "policy": policy,
        "attention": mode,
        "seconds": round(seconds, 3),
        "tokens": result.tokens_generated,
        "tokens_per_s": round(result.tokens_generated / seconds, 3),
        "prompt_tokens": result.prompt_tokens,
        "peak_cache_tokens": result.peak_cache_tokens,
        "evictions": result.evictions,
    }


def plan() -> list[tuple[str, str]]:
    runs = [(name, "recompute") for name in REFERENCES]
    for name in BASELINES:
        needs_attention = "attention_weights" in policy_class(name).requires
        runs += [(name, "recompute"), (name, "eager")] if needs_attention else [(name, "recompute")]
    return runs + [(name, "recompute") for name in REFERENCES]


def mean_speed(rows: list[dict], policy: str, mode: str) -> float | None:
    speeds = [r["tokens_per_s"] for r in rows if (r["policy"], r["attention"]) == (policy, mode)]
    return sum(speeds) / len(speeds) if speeds else None


def table(rows: list[dict]) -> str:
    ref = {name: mean_speed(rows, name, "recompute") for name in REFERENCES}
    lines = [
        "| policy | tok/s recompute | tok/s eager | recompute / full | eager / full "
        "| recompute / epikv | eager / epikv |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in REFERENCES + BASELINES:
        cells = [f"`{name}`"]
        speeds = [mean_speed(rows, name, "recompute"), mean_speed(rows, name, "eager")]
        cells += [f"{v:.2f}" if v else "n/a" for v in speeds]
        for base in ("full", "epikv"):
            cells += [f"{v / ref[base]:.2f}" if v else "n/a" for v in speeds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub id or path (default: the embedded model)")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--problem", type=int, default=0, help="line of the MATH-500 file")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest here)")
    parser.add_argument("--out", type=Path, default=Path("results/baselines_speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model(args.model)
    problem_id, prompt = chat_prompt(DATA, args.problem)
    warm = SamplingConfig(max_new_tokens=16, ignore_eos=True)
    generate(model, tok, [prompt], "full", None, warm)  # first-call costs out of the timings
    rows = []
    for name, mode in plan():
        rows.append(run_one(model, tok, prompt, name, mode, args))
        print(json.dumps(rows[-1]), flush=True)
    config = {
        "model": model_identity(model),
        "dtype": str(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
        "budget": args.budget,
        "forced_tokens": args.tokens,
        "decoding": "greedy, ignore_eos",
        "problem": problem_id,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "note": "eager = the model in eager attention for the run; recompute = SDPA + rows beside it. "
        "full and epikv never read attention (recompute column only).",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "runs": rows}, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
