"""Issue-2 figures on this machine: embedded-model load times and decode speed per policy.

Prints a markdown table and writes results/core_speed.json. Load times run in fresh
processes (first load converts the GGUF into a temporary cache folder; the second reads it).
Speed: one chat prompt, K = 256, 1,024 forced tokens (EOS ignored), greedy, policies run one
after another in this process after a warm-up; ratios are to `full` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LOAD = (
    "import time; t = time.perf_counter(); from epikv.models import load_model; load_model(); "
    "print(time.perf_counter() - t)"
)


def load_seconds(cache_dir: str) -> float:
    env = {"EPIKV_CACHE_DIR": cache_dir, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--policies", nargs="+", default=["full", "epikv-flat", "epikv"])
    parser.add_argument("--out", default="results/core_speed.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as cache:
        first, cached = load_seconds(cache), load_seconds(cache)

    from epikv.generation import SamplingConfig, generate
    from epikv.models import load_model

    model, tok = load_model()
    problem = json.loads(Path("src/epikv/data/math500.jsonl").read_text().splitlines()[0])["problem"]
    prompt = [
        {
            "role": "system",
            "content": "Please reason step by step, and put your final answer within \\boxed{}.",
        },
        {"role": "user", "content": problem},
    ]
    generate(
        model, tok, [prompt], "full", None, SamplingConfig(max_new_tokens=32, ignore_eos=True)
    )  # warm-up
    rows = []
    for name in args.policies:
        sampling = SamplingConfig(max_new_tokens=args.tokens, ignore_eos=True)
        r = generate(model, tok, [prompt], name, args.budget, sampling)[0]
        rows.append(
            {
                "policy": name,
                "tokens_per_second": r.tokens_generated / r.seconds,
                "seconds": r.seconds,
                "peak_cache_tokens": r.peak_cache_tokens,
                "final_cache_tokens": r.final_cache_tokens,
                "evictions": r.evictions,
                "prompt_tokens": r.prompt_tokens,
            }
        )
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["ratio_to_first"] = row["tokens_per_second"] / base
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "first_load_s": first,
        "cached_load_s": cached,
        "budget": args.budget,
        "forced_tokens": args.tokens,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"first load {first:.1f} s, cached load {cached:.1f} s (fresh processes)")
    print(f"| policy | tok/s | x {args.policies[0]} | peak cached | final cached | evictions |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['policy']} | {row['tokens_per_second']:.1f} | {row['ratio_to_first']:.2f} | "
            f"{row['peak_cache_tokens']} | {row['final_cache_tokens']} | {row['evictions']} |"
        )


if __name__ == "__main__":
    main()
