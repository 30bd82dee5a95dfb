"""Benchmark of the vLLM plugin (docs/vllm.md): run in vLLM's environment (``.venv-vllm``).

  .venv-vllm/bin/python scripts/vllm_bench.py throughput --out results/vllm/throughput.json
  .venv-vllm/bin/python scripts/vllm_bench.py capacity --out results/vllm/capacity.json
  .venv-vllm/bin/python scripts/vllm_bench.py chat --out results/vllm/chat.json

``throughput``: plain vLLM and vLLM + epikv (K = 256) on the same 16 chat prompts, greedy, EOS
ignored, T new tokens each, all submitted at once; engines alternate within one run, each in a fresh
child process of the same layout. ``capacity``: a KV pool that holds one full request of ``--tokens``
tokens, ``--requests`` requests of that length under the plugin (and ``--plain-requests`` under plain
vLLM): how many ran at once, preemptions, and whether all finished. ``chat``: short chats (the 16
prompts, ``--chat-tokens`` new tokens each) in a fixed pool of ``--chat-blocks`` blocks: how many ran
at once under each engine. ``--modes`` runs each job in eager mode, vLLM's default compiled mode, or
both. ``--compare-src OTHER/src`` runs the plugin a second time from another checkout in the same
throughput run (before/after a change, side by side); ``--rank-every N`` runs the policy a second
time at tau = 1 ranked every N steps (issue 56: rho against the policy's own tau, side by side).
Every record carries the CPU model, its vector flags and the load average; compare only ratios from
one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT.parent / "shared" / "peers" / "vllm" / "prompts16.jsonl"
BLOCK = 32
RANKED = "rank_every"  # throughput: the policy ranked every --rank-every steps, beside its own tau


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "")
    except OSError:
        return platform.processor()


def cpu_flags() -> list[str]:
    """The vector extensions that decide fp32/bf16 speed on CPU (lscpu's flags)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    return [f for f in wanted if f in flags]


def git_head(folder: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip()


def child(job: dict) -> dict:
    """One engine run in this process (called in a fresh child by :func:`run_child`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import epikv.vllm

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    texts = [json.loads(line)["prompt"] for line in open(job["prompts"]) if line.strip()]
    texts = [texts[i % len(texts)] for i in range(job["n"])]
    ids = []
    for text in texts:
        x = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids.append([int(i) for i in (x["input_ids"] if hasattr(x, "keys") else x)][: job.get("prompt_cut")])
    plugin = (job["policy"], job.get("budget"), job.get("interval"), job.get("rank_every"))
    extra = epikv.vllm.engine_kwargs(*plugin) if job["policy"] != "plain" else {}
    options = {"enable_prefix_caching": False, **extra}
    if job.get("blocks"):
        options["kv_cache_memory_bytes"] = job["blocks"] * BLOCK * job["token_bytes"]
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        enforce_eager=job.get("mode", "eager") == "eager",
        block_size=BLOCK,
        max_model_len=job["max_model_len"],
        seed=0,
        **options,
    )
    init = time.perf_counter() - start
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    seen = {"running": 0, "preempted": 0}
    schedule = scheduler.schedule

    def watch(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seen["running"] = max(seen["running"], len(scheduler.running))
        seen["preempted"] += len(out.preempted_req_ids or ())
        return out

    scheduler.schedule = watch
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=ids[0])], warm, use_tqdm=False)
    seen.update(running=0, preempted=0)
    params = SamplingParams(temperature=0, max_tokens=job["t"], ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
    wall = time.perf_counter() - start
    generated = [len(o.outputs[0].token_ids) for o in outs]
    return {
        **{k: v for k, v in job.items() if k not in ("model", "prompts")},
        "init_s": round(init, 1),
        "wall_s": round(wall, 2),
        "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
        "tokens": sum(generated),
        "tokens_per_s": round(sum(generated) / wall, 2),
        "all_finished": generated == [job["t"]] * job["n"],
        "max_running": seen["running"],
        "preemptions": seen["preempted"],
        "pool_blocks": scheduler.kv_cache_config.num_blocks,
        "loadavg_end": os.getloadavg(),
        "output_hash": hash(tuple(tuple(o.outputs[0].token_ids) for o in outs)) & 0xFFFFFFFF,
    }


def run_child(job: dict) -> dict:
    env = dict(os.environ)
    if job.get("src"):  # the plugin from another checkout (a before/after of one change, one run)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (job["src"], env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, __file__, "child", json.dumps(job)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {**job, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no result"}
    return json.loads(lines[-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kind", choices=["throughput", "capacity", "chat", "child"])
    parser.add_argument("job", nargs="?")
    parser.add_argument("--model", default=None, help="safetensors folder (default: epikv's embedded copy)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policy", default="epikv")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--lengths", default="512,2048", help="throughput: new tokens per request")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4096, help="capacity: tokens per request")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--plain-requests", type=int, default=2)
    parser.add_argument("--modes", default="eager", help="eager, compiled, or eager,compiled")
    parser.add_argument("--chat-tokens", type=int, default=24, help="chat: new tokens per request")
    parser.add_argument("--chat-blocks", type=int, default=40, help="chat: usable blocks in the pool")
    parser.add_argument(
        "--chat-prompt", type=int, default=40, help="chat: prompts cut to this many tokens (0: whole)"
    )
    parser.add_argument(
        "--skip-plain", action="store_true", help="throughput: the plugin only (a peer elsewhere)"
    )
    parser.add_argument(
        "--compare-src",
        default=None,
        help="throughput: also run the plugin from this src folder (another checkout: before/after)",
    )
    parser.add_argument(
        "--interval", type=int, default=None, help="tau of the plugin's runs (default: the policy's)"
    )
    parser.add_argument(
        "--rank-every",
        type=int,
        default=None,
        help="throughput: also the policy at tau = 1 ranked every N steps (issue 56), in the same run",
    )
    parser.add_argument("--out", required=False)
    args = parser.parse_args()
    if args.kind == "child":
        print("RESULT " + json.dumps(child(json.loads(args.job))), flush=True)
        return
    from epikv.models.loading import model_source  # the embedded model's folder, converted once if missing

    model = args.model or model_source(None)
    token_bytes = 30 * 3 * 64 * 2 * (4 if args.dtype == "float32" else 2)
    base = {"model": model, "prompts": str(PROMPTS), "dtype": args.dtype, "token_bytes": token_bytes}
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"eager", "compiled"}:
        parser.error(f"--modes {args.modes!r}: each mode is eager or compiled")
    records = []
    loads = {"loadavg_start": os.getloadavg()}
    if args.compare_src:  # which commit each plugin run is, beside its src
        base["commits"] = {"main": git_head(ROOT), "compare_src": git_head(Path(args.compare_src))}
    if args.kind == "throughput":
        for t, mode in ((int(x), m) for x in args.lengths.split(",") for m in modes):
            for _ in range(args.rounds):
                engines = [] if args.skip_plain else [("plain", None)]
                engines += [(args.policy, None)]
                engines += [(args.policy, args.compare_src)] if args.compare_src else []
                engines += [(args.policy, RANKED)] if args.rank_every else []
                for policy, src in engines:  # alternating, same layout
                    ranked = src is RANKED
                    job = {
                        "src": None if ranked else src,
                        "interval": 1 if ranked else args.interval,
                        "rank_every": args.rank_every if ranked else None,
                        **base,
                        "mode": mode,
                        "policy": policy,
                        "budget": args.budget,
                        "n": 16,
                        "t": t,
                        "blocks": 16 * -(-(t + 256) // BLOCK) + 1,  # every full cache fits: no preemption
                        "max_model_len": t + 256,
                    }
                    records.append(run_child(job))
                    print(json.dumps(records[-1]), flush=True)
    elif args.kind == "chat":
        for mode in modes:
            for policy in ("plain", args.policy):
                job = {
                    **base,
                    "mode": mode,
                    "policy": policy,
                    "budget": args.budget,
                    "n": 16,
                    "t": args.chat_tokens,
                    "prompt_cut": args.chat_prompt or None,
                    "blocks": args.chat_blocks + 1,  # plus vLLM's null block
                    "max_model_len": 512,
                }
                records.append(run_child(job))
                print(json.dumps(records[-1]), flush=True)
    else:
        blocks = (
            -(-(args.tokens + 256) // BLOCK) + 1
        )  # one full request of prompt + tokens, plus the null block
        for mode, (policy, n) in (
            (m, job) for m in modes for job in (("plain", args.plain_requests), (args.policy, args.requests))
        ):
            job = {
                **base,
                "mode": mode,
                "policy": policy,
                "budget": args.budget,
                "n": n,
                "t": args.tokens,
                "blocks": blocks,
                "max_model_len": args.tokens + 256,
            }
            records.append(run_child(job))
            print(json.dumps(records[-1]), flush=True)
    result = {
        "kind": args.kind,
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "threads": os.cpu_count(),
        **loads,
        "loadavg_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "records": records,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
