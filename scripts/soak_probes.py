"""The server-side probes of ``scripts/vllm_soak.py``: resident memory of the server and its children,
its metrics, the machine, and what its log says (split out so each script stays short)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import psutil

METRICS = (
    "epikv:requests_total vllm:request_success_total epikv:requests_aborted_total epikv:evicted_tokens_total "
    "epikv:compactions_total epikv:peak_cache_tokens_count vllm:num_preemptions_total "
    "vllm:request_queue_time_seconds_sum vllm:request_queue_time_seconds_count"
).split()  # each summed over its labels
LOG_FACTS = {  # vLLM's pool line: its "tokens" are its concurrency x max_model_len, not the pool's size
    "kv_cache_log": r"(KV cache size: [\d,]+ tokens, Maximum concurrency .*x)",
    "requests_at_once_log": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
}
PROBLEM = re.compile(r"ERROR|Traceback|EngineDead|epikv: request|died|Killed")


def rss(pid: int) -> dict:
    """Resident memory of the server and each of its children (the engine core among them), MiB."""
    parent = psutil.Process(pid)
    children = parent.children(recursive=True)
    each = {}
    for p in [parent, *children]:
        try:
            each[f"{p.pid} {p.name()}"] = round(p.memory_info().rss / 2**20, 1)
        except psutil.Error:
            continue
    pids = sorted(c.pid for c in children)
    return {"total_mib": round(sum(each.values()), 1), "processes": each, "children": pids}


def metrics(base: str) -> dict:
    """Each metric of METRICS, summed over its labels."""
    lines = httpx.get(base + "/metrics", timeout=30).text.splitlines()
    return {
        name: sum(float(x.split()[-1]) for x in lines if x.startswith(name + "{") or x.startswith(name + " "))
        for name in METRICS
    }


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    field = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in lscpu.splitlines())}
    return {"cpu_model": field.get("Model name"), "cpu_flags": field.get("Flags"), "cpus": os.cpu_count()}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def log_facts(log: Path) -> dict:
    """The pool, vLLM's concurrency and the cap as the server's log gives them, and its problem lines."""
    text = log.read_text(errors="replace") if log.exists() else ""
    facts = {k: (m.group(1) if (m := re.search(p, text)) else None) for k, p in LOG_FACTS.items()}
    problems = [x[:300] for x in text.splitlines() if PROBLEM.search(x)]
    return {**facts, "problem_lines": len(problems), "problem_lines_first": problems[:20]}
