"""Decode with NVIDIA kvpress's decoding-time compression and print one JSON line.

Self-contained on purpose: it runs under a separate virtual environment (kvpress 0.5.5 pins
transformers < 5.3), so it imports only the standard library, torch, transformers and kvpress,
never epikv. :mod:`epikv.bench.peer.study` starts it as a script.

One press per process: ``DecodingPress(base, compression_interval=tau, target_size=K)`` with base
StreamingLLM, Knorm, TOVA or ObservedAttention (H2O-like), the same greedy loop as kvpress's own
pipeline (explicit position ids, EOS ignored), the tokens/s of the decode steps, the peak resident
memory above the loaded model, and the cache's final size per layer. For the bases whose layer-0
scores do not depend on other layers (StreamingLLM by position, Knorm by key norm) it also checks
that the kept set is what the method defines: each kept layer-0 key is matched to the position
whose reference key it equals, and that set is compared with a replay of the schedule by position.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BASES = ("streaming", "knorm", "tova", "observed")
EAGER_BASES = ("observed",)  # reads attention weights from the attention modules


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def make_press(base: str, budget: int, interval: int, n_sink: int):
    import kvpress

    scorer = {
        "streaming": lambda: kvpress.StreamingLLMPress(n_sink=n_sink),
        "knorm": kvpress.KnormPress,
        "tova": kvpress.TOVAPress,
        "observed": kvpress.ObservedAttentionPress,
    }[base]()
    return kvpress.DecodingPress(
        base_press=scorer, compression_interval=interval, target_size=budget, hidden_states_buffer_size=0
    )


def defined_positions(prompt: int, fed: int, budget: int, interval: int, keep) -> list[int]:
    """Positions the method keeps under DecodingPress's schedule (compress every ``interval``
    decode steps to ``budget``), replayed by position; ``keep(positions, budget)`` selects."""
    held = list(range(prompt))
    for step in range(1, fed + 1):
        held.append(prompt + step - 1)
        if step % interval == 0 and len(held) > budget:
            held = keep(held, budget)
    return sorted(held)


def recover_positions(kept: torch.Tensor, reference: torch.Tensor) -> tuple[list[int], float]:
    """Positions whose reference key (N, D) each kept key (k, D) equals; and the worst distance."""
    distance = torch.cdist(kept.float(), reference.float())
    best, index = distance.min(dim=-1)
    return sorted(index.tolist()), float(best.max())


def decode(model, press, ids: torch.Tensor, tokens: int):
    from transformers import DynamicCache

    cache = DynamicCache()
    step_s = []
    with torch.no_grad(), press(model):
        start = time.perf_counter()
        positions = torch.arange(ids.shape[1])[None]
        out = model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        prefill_s = time.perf_counter() - start
        generated = [int(out.logits[0, -1].argmax())]
        for i in range(tokens):
            start = time.perf_counter()
            token = torch.tensor([[generated[-1]]])
            position = torch.tensor([[ids.shape[1] + i]])
            out = model(input_ids=token, past_key_values=cache, position_ids=position)
            generated.append(int(out.logits[0, -1].argmax()))
            step_s.append(time.perf_counter() - start)
    return cache, generated, prefill_s, step_s


def kept_set_check(model, cache, ids: torch.Tensor, generated: list[int], args) -> dict:
    """Compare the layer-0 kept positions per head with the method's definition."""
    from transformers import DynamicCache

    fed = len(generated) - 1  # the last token was never fed
    sequence = torch.cat([ids, torch.tensor([generated[:fed]])], dim=1)
    reference_cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=sequence, past_key_values=reference_cache, logits_to_keep=1)
    reference, kept = reference_cache.layers[0].keys[0], cache.layers[0].keys[0]
    heads = []
    for head in range(kept.shape[0]):
        if args.press == "streaming":

            def keep(held, k):
                return held[: args.n_sink] + held[len(held) - (k - args.n_sink) :]
        else:
            norms = reference[head].norm(dim=-1)

            def keep(held, k, norms=norms):
                return sorted(held, key=lambda p: float(norms[p]))[:k]

        want = defined_positions(ids.shape[1], fed, args.budget, args.interval, keep)
        got, worst = recover_positions(kept[head], reference[head])
        heads.append(
            {
                "head": head,
                "matches": got == want,
                "kept": len(got),
                "extra": len(set(got) - set(want)),
                "max_key_distance": worst,
            }
        )
    return {"checked": True, "layer": 0, "all_match": all(h["matches"] for h in heads), "heads": heads}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpress_runner.py")
    parser.add_argument("--model", required=True, help="a local model folder")
    parser.add_argument("--ids", required=True, help="JSON file with the prompt's token ids")
    parser.add_argument("--press", choices=BASES, required=True)
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--interval", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM

    attn = "eager" if args.press in EAGER_BASES else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=attn
    ).eval()
    ids = torch.tensor([json.loads(Path(args.ids).read_text())])
    press = make_press(args.press, args.budget, args.interval, args.n_sink)
    with torch.no_grad():  # page the weights in (safetensors are mapped lazily) before the baseline
        model(input_ids=ids[:, :8])
    base = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    cache, generated, prefill_s, step_s = decode(model, press, ids, args.tokens)
    peak = _status_bytes("VmHWM") - base
    report = {
        "side": "kvpress",
        "method": args.press,
        "attn_implementation": attn,
        "tokens_per_s": len(step_s) / sum(step_s),
        "prefill_s": prefill_s,
        "peak_bytes": peak,
        "final_cache_tokens": [layer.keys.shape[-2] for layer in cache.layers],
        "versions": {
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }
    if args.press in ("streaming", "knorm"):
        report["kept_set"] = kept_set_check(model, cache, ids, generated, args)
    else:
        report["kept_set"] = {"checked": False, "why": "layer-0 scores depend on attention over the kept set"}
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
