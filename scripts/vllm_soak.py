"""Soak of vLLM's own OpenAI server with the epikv plugin (issue 34 item 10); a benchmark, not a test.

  .venv-vllm/bin/python scripts/vllm_soak.py --out results/vllm/soak.json

Starts ``python -m vllm.entrypoints.openai.api_server`` (the embedded model, ``--policy`` at K = 96,
default ``streaming``, a pool of ``--blocks`` blocks; eager without prefix caching unless
``--compiled`` and ``--prefix-caching``, which needs a policy that protects the prompt, e.g.
``epikv``) and sends equal bursts of concurrent chats reserving about twice the pool: plain,
streamed, leaving mid-stream, stop strings, per-request budgets, bad budgets, long prompts. After
each burst: RSS of the server and its children, ``/metrics``; at the end a chat and ``/health``. One
JSON record, nothing asserted; the server always stopped, the run bounded by ``--time-limit`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from epikv.spec import CacheSpec

sys.path.insert(0, str(Path(__file__).parent))
from soak_probes import log_facts, machine, metrics, rss, uptime

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
BLOCK = 32
FP32_TOKEN_BYTES = 46_080  # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K + V) x 4 bytes
BUDGET, REQUEST_BUDGET, BAD_BUDGET = 96, 48, 100_000
TEXTS = [  # the stop-string clients ask the first: its answer runs past a newline
    "Explain how a rainbow forms, step by step.",
    "What is 17 * 23? Think step by step.",
    "Write a short poem about the sea, then explain its rhyme scheme.",
    "List three prime numbers greater than 50 and prove each is prime.",
]
NOTE = "Note {}: water evaporates from the sea, condenses into clouds and falls as rain. "
# about 300 tokens with the chat template: longer than K + tau, so held whole once, then compacted
LONG_TEXT = "My notes on the water cycle. " + "".join(map(NOTE.format, range(16))) + "Summarize them."
KINDS = {  # kind: (stream, max_tokens, extra body, leave after n chunks, a 400 expected)
    "plain": (False, 96, {}, 0, False),
    "stream": (True, 96, {}, 0, False),
    "leave": (True, 128, {}, 3, False),
    "stop": (False, 96, {"stop": ["\n"]}, 0, False),
    "stop_stream": (True, 96, {"stop": ["\n"]}, 0, False),
    "budget": (False, 96, {"vllm_xargs": {"epikv_budget": REQUEST_BUDGET}}, 0, False),
    "budget_stream": (True, 96, {"vllm_xargs": {"epikv_budget": REQUEST_BUDGET}}, 0, False),
    "bad_budget": (False, 16, {"vllm_xargs": {"epikv_budget": BAD_BUDGET}}, 0, True),
    "long": (False, 64, {}, 0, False),
    "long_stream": (True, 64, {}, 0, False),
}
PATTERN = (  # one burst of 20 (client i is PATTERN[i % 20]): 18 run, 2 are refused
    "plain stream leave long budget plain stream stop bad_budget stream leave budget plain long_stream "
    "stop_stream stream leave budget_stream plain bad_budget"
).split()


def embedded_folder() -> str:
    """The embedded model's folder, as tests/vllm/conftest.py gets it (epikv's own environment)."""
    command = [str(ROOT / ".venv/bin/python"), str(ROOT / "tests/vllm/reference.py"), "folder"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("REFERENCE "))
    return json.loads(line[len("REFERENCE ") :])["folder"]


def server_command(folder: str, port: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        *([] if args.compiled else ["--enforce-eager"]),
        "--max-model-len", "4096", "--served-model-name", MODEL, "--block-size", str(BLOCK),
        "--kv-cache-memory-bytes", str(args.blocks * BLOCK * FP32_TOKEN_BYTES), "--seed", "0",
        "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
        "--additional-config", json.dumps({"epikv": settings(args)}),
    ]  # fmt: skip


def settings(args: argparse.Namespace) -> dict:
    """The plugin's settings (``additional_config["epikv"]``): policy, K, and ``--interval`` if given."""
    return {"policy": args.policy, "budget": BUDGET, **({"interval": args.interval} if args.interval else {})}


def server_spec(folder: str, args: argparse.Namespace) -> CacheSpec:
    """The server's run spec, built as the plugin builds it (its caps are the soak's bounds)."""
    from transformers import AutoConfig

    from epikv.policies.base import ModelInfo
    from epikv.vllm.config import EpiKVSettings

    model = ModelInfo.from_config(AutoConfig.from_pretrained(folder), "smollm2-135m")
    return EpiKVSettings.from_config({"epikv": settings(args)}).spec(model)


def wait_ready(base: str, proc: subprocess.Popen, seconds: float) -> float:
    """Seconds until ``/health`` answers 200; raises if the server exits or never answers."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return round(time.monotonic() - start, 1)
        except httpx.HTTPError:
            time.sleep(1)
    raise RuntimeError(f"the server did not answer /health within {seconds:.0f} s")


def stop_server(proc: subprocess.Popen) -> dict:
    """Terminate the server, then kill it and any child of it still running (each by its pid)."""
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=15)
    for child in alive:
        child.kill()
    return {"returncode": proc.returncode, "children_killed": len(alive)}


def body(kind: str, number: int) -> tuple[dict, int, bool]:
    """Client ``number``'s request, the chunks it reads before it leaves (0: never), a 400 expected."""
    stream, max_tokens, extra, leave_after, expect_400 = KINDS[kind]
    text = LONG_TEXT if kind.startswith("long") else TEXTS[0 if "stop" in extra else number % len(TEXTS)]
    out = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    out.update(temperature=0, **extra)
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    return out, leave_after, expect_400


def by_status(status: int, text: str, expect_400: bool) -> str | None:
    """An outcome from the HTTP status alone (None: a 200 to read on)."""
    if status == 200:
        return "unexpected-2xx" if expect_400 else None
    if status == 400 and expect_400 and f"epikv_budget={BAD_BUDGET}" in text:
        return "4xx-expected"
    return "4xx-unexpected" if 400 <= status < 500 else "5xx" if status >= 500 else "lost"


def counters(data: dict) -> dict:
    usage = data.get("usage") or {}
    stats = (data.get("kv_transfer_params") or {}).get("epikv")
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "tokens": usage.get("completion_tokens"),
        "epikv": stats,
    }


async def plain_call(http: httpx.AsyncClient, url: str, job: dict, expect_400: bool) -> dict:
    reply = await http.post(url, json=job)
    bad = by_status(reply.status_code, reply.text, expect_400)
    if bad:
        return {"outcome": bad, "status": reply.status_code, "detail": reply.text[:300]}
    data = reply.json()
    end = {k: data["choices"][0].get(k) for k in ("finish_reason", "stop_reason")}
    return {"outcome": "completed", **end, **counters(data)}


async def stream_call(http: httpx.AsyncClient, url: str, job: dict, leave_after: int) -> dict:
    async with http.stream("POST", url, json=job) as reply:
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")
            bad = by_status(reply.status_code, text, False)
            return {"outcome": bad, "status": reply.status_code, "detail": text[:300]}
        chunks, end, last = 0, {"finish_reason": None}, {}
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return {"outcome": "completed", **end, "chunks": chunks, **counters(last)}
            event = json.loads(line[6:])
            if "error" in event:  # vLLM's in-stream error (its 500 once the stream has begun)
                return {"outcome": "5xx", "status": 200, "detail": f"error event: {line[6:306]}"}
            chunks += 1
            ends = [c for c in event.get("choices", []) if c.get("finish_reason")]
            end = {k: ends[0].get(k) for k in ("finish_reason", "stop_reason")} if ends else end
            last.update({k: event[k] for k in ("usage", "kv_transfer_params") if event.get(k)})
            if leave_after and chunks >= leave_after and end["finish_reason"] is None:
                return {"outcome": "left", "chunks": chunks}  # leaving the block closes the connection
    return {"outcome": "lost", "chunks": chunks, "detail": "stream ended without [DONE]"}


async def client(http: httpx.AsyncClient, base: str, number: int, timeout: float) -> dict:
    kind = PATTERN[number % len(PATTERN)]
    job, leave_after, expect_400 = body(kind, number)
    url, start, record = base + "/v1/chat/completions", time.monotonic(), {"client": number, "kind": kind}
    streams = job.get("stream")
    call = stream_call(http, url, job, leave_after) if streams else plain_call(http, url, job, expect_400)
    try:
        record.update(await asyncio.wait_for(call, timeout))
    except asyncio.TimeoutError:
        record.update(outcome="lost", detail=f"no answer within {timeout:.0f} s")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        record.update(outcome="lost", detail=f"{type(err).__name__}: {err}"[:300])
    record["seconds"] = round(time.monotonic() - start, 2)
    return record


async def burst(base: str, clients: int, timeout: float) -> list[dict]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as http:
        return await asyncio.gather(*(client(http, base, i, timeout) for i in range(clients)))


def burst_load(base: str, clients: int, spec: CacheSpec) -> tuple[dict[str, int], int]:
    """Each prompt's tokens (the server's own ``/tokenize``, chat template included), and the blocks one
    burst reserves in all: min(cap, P + max_tokens) each (``CacheSpec.cap_tokens``, docs/vllm.md); none
    for a request the front end refuses."""
    prompts = {}
    for text in [*TEXTS, LONG_TEXT]:
        ask = {"model": MODEL, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        prompts[text] = httpx.post(base + "/tokenize", json=ask, timeout=60).json()["count"]
    blocks = 0
    for i in range(clients):
        job, _, expect_400 = body(PATTERN[i % len(PATTERN)], i)
        k, p = job.get("vllm_xargs", {}).get("epikv_budget", BUDGET), prompts[job["messages"][0]["content"]]
        blocks += 0 if expect_400 else math.ceil(min(spec.cap_tokens(p, k), p + job["max_tokens"]) / BLOCK)
    return prompts, blocks


def summarize(records: list[dict], spec: CacheSpec) -> dict:
    """Outcome counts, by kind, finish reasons, and each completed request's peak against its cap."""
    done = [(r, r.get("epikv") or {}) for r in records if r["outcome"] == "completed"]
    bounded = [(r, s) for r, s in done if r.get("prompt_tokens") and "budget" in s]
    return {
        "outcomes": dict(Counter(r["outcome"] for r in records)),
        "by_kind": dict(sorted(Counter(f"{r['kind']}: {r['outcome']}" for r in records).items())),
        "finish_reasons": dict(Counter(f"{r['finish_reason']} {r.get('stop_reason')!r}" for r, _ in done)),
        "completed_without_counters": [r["client"] for r, s in done if "peak_cache_tokens" not in s],
        "completed_over_cap": [
            r["client"]
            for r, s in bounded
            if s["peak_cache_tokens"] > spec.cap_tokens(r["prompt_tokens"], s["budget"])
        ],
        "long_prompt_tokens_and_peak": [
            (r["prompt_tokens"], s.get("peak_cache_tokens")) for r, s in done if r["kind"].startswith("long")
        ],
        "seconds_max": max((r["seconds"] for r in records), default=0),
    }


def final_check(base: str) -> dict:
    hello = [{"role": "user", "content": "Hi!"}]
    ask = {"model": MODEL, "max_tokens": 16, "temperature": 0, "messages": hello}
    try:
        reply = httpx.post(base + "/v1/chat/completions", json=ask, timeout=300)
        answer = reply.json()["choices"][0]["message"]["content"][:80] if reply.status_code == 200 else None
        health = httpx.get(base + "/health", timeout=30).status_code
        return {"chat_status": reply.status_code, "chat_answer": answer, "health_status": health}
    except (httpx.HTTPError, KeyError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def soak(args: argparse.Namespace, record: dict, proc: subprocess.Popen, base: str) -> None:
    """The bursts, each followed by a sample of RSS and metrics, then the final check."""
    deadline = time.monotonic() + args.time_limit - 120  # leaves time to check, stop and write
    record["startup_seconds"] = wait_ready(base, proc, min(300.0, deadline - time.monotonic()))
    spec = server_spec(record["config"]["command"][4], args)
    record["config"]["tau"] = spec.interval
    record["prompt_tokens"], record["config"]["burst_reserved_blocks"] = burst_load(base, args.clients, spec)
    record["idle"] = {"rss": rss(proc.pid), "metrics": metrics(base)}
    children = record["idle"]["rss"]["children"]
    for n in range(args.bursts):
        left = deadline - time.monotonic()
        if left < 60:
            record["bursts_skipped"] = args.bursts - n
            break
        start = time.monotonic()
        records = asyncio.run(burst(base, args.clients, min(args.client_timeout, left)))
        seconds = round(time.monotonic() - start, 1)
        time.sleep(3)  # lets the aborts of clients that left reach the counters
        alive = proc.poll() is None
        sample = {"rss": rss(proc.pid), "metrics": metrics(base)} if alive else {"rss": None, "metrics": None}
        same = alive and sample["rss"]["children"] == children  # the engine core was not restarted
        summary = summarize(records, spec)
        state = {"server_alive": alive, "children_unchanged": same, **sample}
        record["bursts"].append({"seconds": seconds, **summary, **state, "clients": records})
        mib = sample["rss"]["total_mib"] if alive else None
        print(f"burst {n + 1}: {seconds} s, {summary['outcomes']}, RSS {mib} MiB", flush=True)
        if not alive:
            break
    record["final_check"] = final_check(base) if proc.poll() is None else {"error": "server exited"}
    record["final_metrics"] = metrics(base) if proc.poll() is None else None


def targets(record: dict) -> dict:
    """The soak's targets, reported against, never asserted."""
    bursts = record["bursts"]
    total = sum((Counter(b["outcomes"]) for b in bursts), Counter())
    final, m = record.get("final_check", {}), record.get("final_metrics") or {}
    rss_mib = [b["rss"]["total_mib"] for b in bursts if b.get("rss")]
    return {
        "engine_deaths": sum(not (b["server_alive"] and b["children_unchanged"]) for b in bursts),
        "lost": total["lost"],
        "unexpected_4xx_5xx": total["4xx-unexpected"] + total["5xx"] + total["unexpected-2xx"],
        "epikv_requests_total_equals_vllm_success": m.get("epikv:requests_total")
        == m.get("vllm:request_success_total"),
        "aborted_total_vs_clients_left": [m.get("epikv:requests_aborted_total"), total["left"]],
        "rss_last_minus_first_burst_mib": round(rss_mib[-1] - rss_mib[0], 1) if len(rss_mib) > 1 else None,
        "answers_afterwards": final.get("chat_status") == 200 and final.get("health_status") == 200,
    }


def config(args: argparse.Namespace, command: list[str]) -> dict:
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    budgets = {"budget": BUDGET, "request_budget": REQUEST_BUDGET, "bad_budget": BAD_BUDGET}
    pool = {"block_size": BLOCK, "pool_tokens": args.blocks * BLOCK}  # its bytes: --kv-cache-memory-bytes
    return {"command": command, **budgets, **pool, **options, "kinds": KINDS, "pattern": PATTERN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results/vllm/soak.json")
    parser.add_argument("--log", type=Path, default=Path("/tmp/epikv_vllm_soak/server.log"))
    parser.add_argument("--clients", type=int, default=20, help="clients per burst")
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=40, help="the KV pool, in blocks of 32 tokens")
    parser.add_argument("--client-timeout", type=float, default=300.0)
    parser.add_argument("--time-limit", type=float, default=900.0, help="for the whole run, seconds")
    parser.add_argument("--policy", default="streaming", help="the server's policy (K = 96)")
    parser.add_argument("--interval", type=int, default=None, help="the policy's tau (default: its own)")
    parser.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode, not eager")
    parser.add_argument(
        "--prefix-caching", action="store_true", help="prefix caching on (a policy that protects the prompt)"
    )
    args = parser.parse_args()

    def out_of_time(*_: object) -> None:
        raise TimeoutError(f"the soak passed its time limit of {args.time_limit:.0f} s")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.time_limit))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = server_command(embedded_folder(), port, args)
    record: dict = {"config": config(args, command), "machine": machine(), "uptime_before": uptime()}
    record["bursts"] = []
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would set the pool
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with open(args.log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        soak(args, record, proc, f"http://127.0.0.1:{port}")
    except Exception as err:  # a benchmark: record what stopped it, then stop the server
        record["error"] = f"{type(err).__name__}: {err}"[:500]
    finally:
        signal.alarm(0)
        record["server_stop"] = stop_server(proc)
        record["uptime_after"] = uptime()
        record["log"] = {"path": str(args.log), **log_facts(args.log)}
        record["targets"] = targets(record)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        tail = args.log.read_text(errors="replace").splitlines()[-200:] if args.log.exists() else []
        args.out.with_suffix(".log").write_text("\n".join(tail) + "\n")
    print(json.dumps({"targets": record["targets"], "error": record.get("error")}, indent=1))


if __name__ == "__main__":
    main()
