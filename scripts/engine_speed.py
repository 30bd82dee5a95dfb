"""Before/after decode speed of ``generate``, side by side in one run (issue: one decode engine).

Each measurement is a fresh process that loads the embedded model, warms up, and times
``epikv.generation.generate`` (or plain ``model.generate`` with a ``DynamicCache``) for a batch of
GSM8K prompts over a forced number of new tokens. "before" runs the code of another checkout (its
``src`` put first on ``sys.path``), "after" this one; runs are interleaved and their order rotates
between repeats, and the load average is recorded beside each run. Writes JSON (and prints a table).

    git worktree add /tmp/before 092398f
    .venv/bin/python scripts/engine_speed.py --before-src /tmp/before/src --out results/engine_speed.json
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

HERE = Path(__file__).resolve().parents[1] / "src"

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
variant, policy = sys.argv[2], sys.argv[3]
batch, tokens, budget = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
from importlib import resources
from epikv.models import load_model
from epikv.generation import SamplingConfig, encode_prompts, generate
model, tok = load_model()
lines = resources.files("epikv").joinpath("data", "gsm8k.jsonl").read_text().splitlines()
prompts = [json.loads(line)["problem"] for line in lines[:batch]]
if variant == "plain":
    from transformers import DynamicCache
    ids, mask = encode_prompts(tok, prompts)
    run = lambda n: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, cache=DynamicCache())
else:
    k = None if policy == "full" else budget
    sampling = lambda n: SamplingConfig(max_new_tokens=n, ignore_eos=True)
    run = lambda n: generate(model, tok, prompts, policy, k, sampling(n))
with torch.no_grad():
    run(16)
    started = time.perf_counter()
    run(tokens)
    seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "tokens_per_s": batch * tokens / seconds}))
"""


def measure(variant: str, src: Path, policy: str, batch: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
    argv = [sys.executable, "-c", WORKER, str(args.threads), variant, policy, str(batch), str(args.tokens)]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run([*argv, str(args.budget)], env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(load_before=load_before, load_after=os.getloadavg()[0], wall=time.perf_counter() - started)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-src", type=Path, required=True, help="src folder of the older checkout")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--policies", nargs="+", default=["full", "epikv"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cells = [("plain", HERE, "full", b) for b in args.batches]
    cells += [(v, src, p, b) for b in args.batches for p in args.policies for v, src in
              (("before", args.before_src), ("after", HERE))]  # fmt: skip
    runs: list[dict] = []
    for repeat in range(args.repeats):
        shift = repeat % len(cells)
        for variant, src, policy, batch in cells[shift:] + cells[:shift]:
            result = measure(variant, src, policy, batch, args)
            runs.append({"repeat": repeat, "variant": variant, "policy": policy, "batch": batch, **result})
            print(json.dumps(runs[-1]), flush=True)
            args.out.write_text(json.dumps({"config": vars(args) | {"before_src": str(args.before_src),
                                            "out": str(args.out)}, "runs": runs}, indent=2))  # fmt: skip
    table = summarize(runs)
    args.out.write_text(
        json.dumps(
            {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "table": table}, indent=2
        )
    )
    print("| batch | policy | plain model.generate | before | after | after / before |")
    print("|---|---|---|---|---|---|")
    for row in table:
        print(
            f"| {row['batch']} | {row['policy']} | {row['plain']:.1f} | {row['before']:.1f} | "
            f"{row['after']:.1f} | {row['after'] / row['before']:.3f} |"
        )


def summarize(runs: list[dict]) -> list[dict]:
    """Median tokens/s per (batch, policy, variant)."""

    def median(**match: object) -> float:
        values = [r["tokens_per_s"] for r in runs if all(r[k] == v for k, v in match.items())]
        return statistics.median(values)

    table = []
    for batch in sorted({r["batch"] for r in runs}):
        for policy in sorted({r["policy"] for r in runs if r["variant"] != "plain"}):
            table.append(
                {
                    "batch": batch,
                    "policy": policy,
                    "plain": median(variant="plain", batch=batch),
                    "before": median(variant="before", policy=policy, batch=batch),
                    "after": median(variant="after", policy=policy, batch=batch),
                }
            )
    return table


if __name__ == "__main__":
    main()
