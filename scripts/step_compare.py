"""Decode-step time of one cell, for a before/after comparison across two checkouts of epikv.

Run it with PYTHONPATH pointing at a checkout's ``src`` (``epikv bench step`` needs the current
code; this script uses only calls both sides have: Runner.prefill/extend/decode and cache.append).
Prints one JSON line: the cell, the median and every step's milliseconds, and the load average.

    PYTHONPATH=src python scripts/step_compare.py --dtype float32 --policy full --context 2048 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from epikv.engine.runner import Runner
    from epikv.integration import build_spec
    from epikv.models import load_model

    model, _ = load_model(dtype=getattr(torch, args.dtype))
    budget = None if args.policy == "full" else args.context - 128  # tau 128: the cell holds K + tau
    runner = Runner(model, build_spec(model, args.policy, budget))
    ids = torch.randint(
        0, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)
    )
    source = runner.new_cache()
    runner.prefill(source, ids[:32].tolist())
    runner.extend(source, ids[32:-1].tolist())
    if budget is not None and not source.row_compactions[0]:
        source.compact()  # the same state on both sides: just after a compaction (K tokens held)
    if hasattr(source, "arena"):  # the arena: a batch is the source row appended (copied) B times
        cache = runner.new_cache()
        for _ in range(args.batch):
            cache.append(source)
    else:  # before the arena: take_rows with a repeated index replicates the row
        cache = source
        cache.take_rows([0] * args.batch)
    tokens = torch.zeros(args.batch, dtype=torch.long)
    times = []
    with runner.attachment:
        for index in range(2 + args.steps):
            start = time.perf_counter()
            tokens = runner.decode(cache, tokens).argmax(dim=-1)
            if index >= 2:
                times.append(1e3 * (time.perf_counter() - start))
    print(
        json.dumps(
            {**vars(args), "median_ms": statistics.median(times), "ms": times, "load": os.getloadavg()}
        )
    )


if __name__ == "__main__":
    main()
