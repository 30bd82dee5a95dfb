"""Decode speed by torch thread count, on an idle machine and under a known load (issue: first hour).

For each condition (``--loads``: how many busy-looping processes run beside it; 0 = idle)
and each thread count, a fresh process loads the embedded model and times ``epikv generate``
(batch 1, ``--tokens`` forced new tokens, policy ``epikv``). Runs are interleaved and repeated; the
load average is recorded beside each. Writes JSON and prints a table.

    .venv/bin/python scripts/thread_defaults.py --out results/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from epikv.models import load_model
from epikv.generation import SamplingConfig, generate
model, tok = load_model()
prompt = "Explain how a rainbow forms, step by step."
generate(model, tok, [prompt], "epikv", 256, SamplingConfig(max_new_tokens=8, ignore_eos=True))
started = time.perf_counter()
generate(model, tok, [prompt], "epikv", 256, SamplingConfig(max_new_tokens=int(sys.argv[2]), ignore_eos=True))
print(json.dumps({"tokens_per_s": int(sys.argv[2]) / (time.perf_counter() - started)}))
"""

SPIN = "while True: pass"


def run(threads: int, tokens: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", WORKER, str(threads), str(tokens)], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside it")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        for spin in args.loads:
            condition = f"spinners={spin}"
            spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(spin)]
            try:
                time.sleep(2 if spinners else 0)
                order = args.threads if repeat % 2 == 0 else list(reversed(args.threads))
                for threads in order:
                    load = os.getloadavg()[0]
                    speed = run(threads, args.tokens)
                    runs.append({"repeat": repeat, "condition": condition, "threads": threads,
                                 "tokens_per_s": speed, "load_before": load})  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
            finally:
                for spinner in spinners:
                    spinner.kill()
    table = {
        f"{c}/{t}": statistics.median(
            r["tokens_per_s"] for r in runs if r["condition"] == c and r["threads"] == t
        )
        for c in (f"spinners={spin}" for spin in args.loads)
        for t in args.threads
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                    "median_tokens_per_s": table}, indent=2))  # fmt: skip
    for key, value in table.items():
        print(f"{key}: {value:.1f} tok/s")


if __name__ == "__main__":
    main()
