"""Resident memory of the engine against generated length: N requests of one policy decode T tokens
together (EOS ignored) and the process's RSS and the arena's KV bytes are sampled every S steps.
With an evicting policy both must stay flat once every row has reached K + tau.

    .venv/bin/python scripts/rss_growth.py --policy epikv --budget 256 -n 16 -t 2048 --out R.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from epikv.bench.shared.machine import current_rss
from epikv.bench.shared.prompt_loading import load_prompts, prompt_token_ids
from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.models import load_model, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="epikv")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("-n", type=int, default=16)
    parser.add_argument("-t", type=int, default=2048)
    parser.add_argument("--every", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, note = resolve_dtype(args.dtype)
    model, tokenizer = load_model(dtype=dtype)
    spec = build_spec(model, args.policy, args.budget if args.policy != "full" else None)
    engine = Engine(model, spec)
    for text in load_prompts("gsm8k", args.n):
        engine.submit(Request(prompt_token_ids(tokenizer, text), args.t))
    samples, started, steps = [], time.time(), 0
    with engine:
        while engine.has_work():
            engine.step()
            steps += 1
            if steps % args.every == 0 or not engine.has_work():
                samples.append(
                    {
                        "step": steps,
                        "rss_bytes": current_rss(),
                        "kv_bytes": engine.cache.kv_bytes(),
                        "cached_tokens": sum(engine.cache.held),
                        "seconds": time.time() - started,
                    }
                )
                print(json.dumps(samples[-1]), flush=True)
    document = {"config": vars(args), "dtype": note, "load_average": os.getloadavg(), "samples": samples}
    with open(args.out, "w") as f:
        json.dump(document, f, indent=2)


if __name__ == "__main__":
    main()
