"""The accuracy study's fast-path target (issue 41): one of its cells on vLLM with the plugin against
the same cell on epikv's own engine, in one run, back to back, on an idle machine.

  .venv/bin/python scripts/accuracy_speed.py --cell gsm8k/epikv@K192 --problems 64 \
      --out results/accuracy/speed.json [--eager]

Each engine generates the cell's first ``--problems`` problems exactly as the study does (same
prompts, precision, cap, and each engine's study batch) into a scratch folder; the tokens per second
of each (generated tokens over the generate calls' wall time, engine start-up excluded) and their
ratio are written with the CPU's model and flags and the load average before and after
(``--eager`` adds vLLM's eager mode at the same batch). Whether the engines wrote the same tokens is
recorded too (in bf16 they need not).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from epikv.bench.accuracy.cells import timed_cell
from epikv.bench.accuracy.design import Study
from epikv.bench.shared import machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="gsm8k/epikv@K192")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--out", required=True)
    parser.add_argument("--eager", action="store_true", help="also vLLM's eager mode, same batch")
    args = parser.parse_args()
    study = Study()
    with tempfile.TemporaryDirectory() as scratch:
        plugin = timed_cell(study, args.cell, study.engine, study.batch_size, args.problems, scratch + "/v")
        engine = timed_cell(study, args.cell, "epikv", study.engine_batch, args.problems, scratch + "/e")
        eager = None
        if args.eager:
            eager = timed_cell(study, args.cell, "vllm", study.batch_size, args.problems, scratch + "/g")
    same = sum(plugin["token_ids"][i] == engine["token_ids"].get(i) for i in plugin["token_ids"])
    eager_same = None
    if eager is not None:
        eager_same = sum(eager["token_ids"][i] == plugin["token_ids"].get(i) for i in eager["token_ids"])
    for run in (plugin, engine, eager):
        if run is not None:
            del run["token_ids"]
    doc = {
        "cell": args.cell, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": machine.cpu(),
        "plugin": plugin, "engine": engine,
        "ratio": round(plugin["tokens_per_s"] / engine["tokens_per_s"], 2),
        "identical_generations": same, "target": ">= 1.3x (issue 41)",
    }  # fmt: skip
    if eager is not None:
        doc["eager"] = eager
        doc["eager_ratio"] = round(eager["tokens_per_s"] / engine["tokens_per_s"], 2)
        doc["eager_identical_to_compiled"] = eager_same
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
    print(json.dumps({k: doc[k] for k in ("cell", "ratio", "identical_generations")}))


if __name__ == "__main__":
    main()
