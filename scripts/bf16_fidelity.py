"""What bf16 costs against fp32, full cache, on the fidelity genres: the embedded model in both
precisions reads the same passages (forced genres: the passage's own continuation; gsm8k-greedy: the
fp32 model's greedy trace), and at every continuation position we compare the next-token choice
(top-1 agreement) and the distributions (KL(fp32 || bf16)). For gsm8k-greedy it also runs bf16
greedy from the same prompts and reports where its trace first leaves fp32's.

    .venv/bin/python scripts/bf16_fidelity.py --prompts 8 --trace-tokens 512 --out results/bench/bf16
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from epikv.bench.fidelity.genres import load_genre
from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.models import load_model


def greedy(model, prompts: list[tuple[int, ...]], tokens: int) -> list[list[int]]:
    engine = Engine(model, build_spec(model, "full"))
    done = engine.run([Request(list(p), tokens) for p in prompts])
    return [c.token_ids for c in done]


@torch.no_grad()
def position_logprobs(model, ids: list[int], start: int) -> torch.Tensor:
    """log-probabilities (float32) of the next token at positions start-1 .. len-2, (T, V)."""
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, start - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--genres", default="prose,code,math500-solutions,gsm8k-greedy")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--trace-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started, load_before = time.time(), os.getloadavg()
    fp32, tokenizer = load_model(dtype=torch.float32)
    bf16, _ = load_model(dtype=torch.bfloat16)
    results = {}
    for genre in args.genres.split(","):
        items = load_genre(genre, tokenizer, trace_tokens=args.trace_tokens, count=args.prompts)
        if items[0].forced:
            traces = [list(item.continuation_ids) for item in items]
            first_divergence = None
        else:
            traces = greedy(fp32, [item.prompt_ids for item in items], args.trace_tokens)
            ours = greedy(bf16, [item.prompt_ids for item in items], args.trace_tokens)
            first_divergence = [
                next((i for i, (a, b) in enumerate(zip(t, o, strict=False)) if a != b), None)
                for t, o in zip(traces, ours, strict=True)
            ]
        agree, kl, count = 0, 0.0, 0
        for item, trace in zip(items, traces, strict=True):
            ids = [*item.prompt_ids, *trace]
            start = len(item.prompt_ids)
            p32 = position_logprobs(fp32, ids, start)
            p16 = position_logprobs(bf16, ids, start)
            agree += int((p32.argmax(-1) == p16.argmax(-1)).sum())
            kl += float((p32.exp() * (p32 - p16)).sum())
            count += p32.shape[0]
        results[genre] = {
            "prompts": len(items),
            "positions": count,
            "top1_agreement": agree / count,
            "mean_kl_fp32_bf16": kl / count,
            "bf16_greedy_first_divergence": first_divergence,
        }
        print(genre, json.dumps(results[genre]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "config": vars(args),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": time.time() - started,
        "results": results,
    }
    (out / "bf16_fidelity.json").write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
