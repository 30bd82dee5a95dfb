"""``epikv bench serve --soak SECONDS``: one server under bounded bursts for a while, and what leaked.

The server runs ``soak_rows`` requests at once (``--max-batch``) with ``soak_rows // 2`` allowed to
wait, and is sent bursts of ``2 * soak_rows`` clients at once, burst after burst until the time is
up. In every burst most clients send a chat request (streamed and not, alternately), one in seven
leaves after a few chunks, one in seven sends a malformed body. Every client ends in exactly one of:
``completed`` (a whole answer), ``429``, ``left`` (it closed on purpose), ``4xx`` (its malformed
body refused, as it should be), ``5xx``, or ``lost`` (anything else: a connection error, a timeout,
a stream that ended without its answer, a malformed body that was not refused). After each burst a
one-token probe refreshes the gauges, which must read zero, and the server's resident memory is
sampled. Targets: 0 lost, 0 5xx, RSS flat after the first burst. Nothing is asserted here, and no
server is started here (:func:`epikv.bench.serve.study.soak` starts it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from epikv.bench.shared import documents, figures, prompt_loading

OUTCOMES = ("completed", "429", "left", "4xx", "5xx", "lost")
MALFORMED: list[bytes] = [
    b"[" * 20_000 + b"]" * 20_000,
    b'{"model": "bench", "messages": [',
    b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
    + b"9" * 5000
    + b"}",
    b'{"model": "bench", "messages": "hi"}',
    b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}',
    b"",
]


def kind_of(index: int) -> str:
    return {5: "leave", 6: "malformed"}.get(index % 7, "normal")


async def one_client(client: Any, url: str, index: int, prompt: str, max_tokens: int) -> str:
    """One client of a burst; returns its outcome (see the module docstring)."""
    kind = kind_of(index)
    try:
        if kind == "malformed":
            body = MALFORMED[index % len(MALFORMED)]
            response = await client.post(url, content=body, headers={"content-type": "application/json"})
            return _status(response.status_code, refused="4xx")
        stream = kind == "leave" or index % 2 == 0
        body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
        if not stream:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                return _status(response.status_code)
            return "completed" if response.json()["usage"]["completion_tokens"] == max_tokens else "lost"
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return _status(response.status_code)
            chunks, done, failed = 0, False, False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunks += 1
                    failed = failed or '"error"' in line
                    if kind == "leave" and chunks == 3:
                        return "left"  # closing the stream here is the client leaving
            return "completed" if done and not failed else "lost"
    except Exception:  # a connection error or timeout of any kind is what "lost" counts
        return "lost"


def _status(code: int, refused: str = "lost") -> str:
    """A non-200 answer: a 4xx is ``refused`` for a malformed body and lost for a valid one."""
    if code == 429:
        return "429"
    return refused if 400 <= code < 500 else "5xx" if code >= 500 else "lost"


async def burst(url: str, prompts: list[str], clients: int, max_tokens: int, first: int) -> dict[str, int]:
    import httpx

    target = f"{url}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=300) as client:
        indices = range(first, first + clients)
        outcomes = await asyncio.gather(
            *(one_client(client, target, i, prompts[i % len(prompts)], max_tokens) for i in indices)
        )
    counts = dict.fromkeys(OUTCOMES, 0)
    for outcome in outcomes:
        counts[outcome] += 1
    return counts


async def gauges_after_probe(url: str) -> dict[str, float]:
    """One-token request (so the gauges are refreshed by a step), then the gauges that must be 0."""
    import httpx

    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(timeout=60) as client:
        await client.post(f"{url}/v1/chat/completions", json=body)
        text = (await client.get(f"{url}/metrics")).text
    names = (
        "epikv_running_rows",
        "epikv_queue_length",
        "epikv_kv_pool_reserved_slots",
        "epikv_cached_tokens",
    )
    return {
        n: float(line.split()[1]) for line in text.splitlines() for n in names if line.startswith(f"{n} ")
    }


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run_soak(config: Any, reporter: documents.Reporter, url: str, process: Any) -> dict[str, Any]:
    """Bursts against the server at ``url`` (its ``process`` for RSS) until ``config.soak_s`` is up."""
    clients = 2 * config.soak_rows
    prompts = prompt_loading.load_prompts(config.prompt_source, 32, 0)
    totals, bursts = dict.fromkeys(OUTCOMES, 0), []
    load = [os.getloadavg()[0]]
    started = time.monotonic()
    bar = reporter.bar(int(config.soak_s), "serve soak", unit="s")
    while time.monotonic() - started < config.soak_s:
        counts = asyncio.run(burst(url, prompts, clients, config.max_tokens, len(bursts) * clients))
        gauges = asyncio.run(gauges_after_probe(url))
        elapsed = time.monotonic() - started
        bursts.append({"t_s": round(elapsed, 1), **counts, "rss_mb": rss_mb(process.pid), "gauges": gauges})
        for key in OUTCOMES:
            totals[key] += counts[key]
        load.append(os.getloadavg()[0])
        bar.update(min(int(elapsed), int(config.soak_s)) - bar.n)
    bar.close()
    return soak_results(config, bursts, totals, load, process.poll() is None)


def soak_arguments(rows: int) -> list[str]:
    return ["--max-batch", str(rows), "--max-waiting", str(max(1, rows // 2)), "--no-access-log"]


def soak_results(
    config: Any, bursts: list[dict], totals: dict[str, int], load: list[float], alive: bool
) -> dict[str, Any]:
    rss = [b["rss_mb"] for b in bursts if b["rss_mb"] is not None]
    growth = rss[-1] - rss[0] if len(rss) > 1 else 0.0
    gauges_zero = all(all(v == 0 for v in b["gauges"].values()) for b in bursts)
    soak = {"seconds": config.soak_s, "rows": config.soak_rows, "clients_per_burst": 2 * config.soak_rows,
            "bursts": bursts, "totals": totals, "rss_growth_after_first_burst_mb": growth,
            "gauges_zero_after_every_burst": gauges_zero, "server_alive": alive,
            "load_average": load}  # fmt: skip
    soak["targets"] = {"lost==0": totals["lost"] == 0, "5xx==0": totals["5xx"] == 0,
                       "rss_growth_after_first_burst_mb": growth}  # fmt: skip
    return {"soak": soak}


def plot_soak(results: dict[str, Any], png: Path) -> Path:
    """Resident memory after each burst (left) and each burst's outcomes (right)."""
    soak = results["soak"]
    figure, axes = figures.new_figure(width=11.0, height=4.0, ncols=2)
    times = [b["t_s"] for b in soak["bursts"]]
    axes[0].plot(times, [b["rss_mb"] for b in soak["bursts"]], "o-")
    axes[0].set_xlabel("seconds")
    axes[0].set_ylabel("server RSS after the burst (MiB)")
    bottom = [0] * len(times)
    for index, outcome in enumerate(OUTCOMES):
        values = [b[outcome] for b in soak["bursts"]]
        axes[1].bar(range(len(times)), values, bottom=bottom, color=f"C{index}", label=outcome)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    axes[1].set_xlabel("burst")
    axes[1].set_ylabel("clients")
    axes[1].legend(fontsize=8)
    axes[1].set_title(json.dumps(soak["totals"]), fontsize=7)
    return figures.save_figure(figure, png)
