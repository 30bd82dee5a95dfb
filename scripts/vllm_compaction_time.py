"""Time the plugin spends compacting (issue 42 item 9), before and after a change, in one run.

  .venv-vllm/bin/python scripts/vllm_compaction_time.py --src ../before/src --src src --rounds 2 \
      --out results/vllm/compaction_time.json

Each run is a fresh child process with the plugin imported from one ``--src`` folder (another
checkout's ``src`` for "before"), the runs alternating: 16 chat prompts (``../shared/peers/vllm``),
``--tokens`` new tokens each (512; EOS ignored), greedy, float32, `epikv` (Seg-Q) K = 256, blocks of 32, eager
mode, in-process engine. The plugin's compaction (``RowCompactions._compact``: scoring, selection and
the page move) is timed around each call. Records: seconds in compactions, calls, compacted rows,
milliseconds per compacted row, its share of the generate wall time, a hash of every token (the
same hash means the same kept sets' tokens), the CPU model, flags and load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT.parent / "shared" / "peers" / "vllm" / "prompts16.jsonl"
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_bench import cpu_flags, cpu_model, git_head  # noqa: E402


def child(mode: str, tokens: int) -> dict:
    """One engine run in this process; the plugin is whatever ``epikv`` this process imports."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import epikv
    import epikv.vllm
    from epikv.vllm.step_compact import RowCompactions

    total = {"s": 0.0, "calls": 0, "rows": 0}
    compact = RowCompactions._compact

    def timed(self, batch, ids, books, state, rows):
        start = time.perf_counter()
        out = compact(self, batch, ids, books, state, rows)
        total["s"] += time.perf_counter() - start
        total["calls"] += 1
        total["rows"] += len(rows)
        return out

    RowCompactions._compact = timed
    from epikv.models.loading import model_source  # the embedded model's folder, converted once if missing

    model = model_source(None)
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    ids = []
    for text in texts:
        x = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids.append([int(i) for i in (x["input_ids"] if hasattr(x, "keys") else x)])
    llm = LLM(
        model=model, dtype="float32", enforce_eager=mode == "eager", block_size=32,
        max_model_len=tokens + 256, seed=0, enable_prefix_caching=False,
        **epikv.vllm.engine_kwargs("epikv", 256),
    )  # fmt: skip
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=ids[0])], warm, use_tqdm=False)
    total.update(s=0.0, calls=0, rows=0)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {
        "epikv": str(Path(epikv.__file__).parents[1]),
        "mode": mode,
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "compact_s": round(total["s"], 3),
        "calls": total["calls"],
        "rows": total["rows"],
        "ms_per_row": round(1000 * total["s"] / max(total["rows"], 1), 2),
        "share_pct": round(100 * total["s"] / wall, 2),
        "tokens_hash": hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xFFFFFFFF,
        "loadavg_end": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--src", action="append", default=[], help="a src folder to import epikv from (repeat)"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    parser.add_argument("--tokens", type=int, default=512, help="new tokens per request")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.mode, args.tokens)), flush=True)
        return
    records = []
    for _ in range(args.rounds):
        for src in args.src or [str(ROOT / "src")]:
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            cmd = [sys.executable, __file__, "--child", "--mode", args.mode, "--tokens", str(args.tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            record = json.loads(lines[-1][7:]) if lines else {"error": done.stderr.strip()[-500:]}
            record["commit"] = git_head(Path(src).resolve().parent)
            records.append(record)
            print(json.dumps(record), flush=True)
    result = {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "records": records,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
