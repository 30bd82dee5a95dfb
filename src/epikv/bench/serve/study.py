"""``epikv bench serve``: the server under closed-loop concurrent clients, per policy, side by side.

One ``epikv serve`` subprocess per policy is started (all at once, on free loopback ports) and driven
over HTTP: at each concurrency c, c clients each send streamed chat requests one after another
(fixed GSM8K prompts, fixed ``max_tokens``, ``ignore_eos``), the policies taking turns level by level
so a change in the machine's load reaches them alike. Recorded per (policy, c): aggregate tokens/s,
time to first token and inter-token latency (p50/p99, from chunk arrival times), and the server's
peak resident memory. The **capacity run** gives every policy the same KV pool (enough for
``pool_requests`` full-cache requests) and sends each policy ``capacity_waves`` times the requests
its pool admits at once (pool // (K + tau), or pool // (prompt + max_tokens) for the full cache, from
the spec the server logs): how many ran at once (the server's own gauge) and the throughput. It also
times ``epikv generate`` on the same request, for the serving overhead at c = 1. Targets are
reported, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epikv.bench.serve.clients import closed_loop
from epikv.bench.serve.soak import plot_soak, run_soak, soak_arguments
from epikv.bench.shared import documents, figures, prompt_loading
from epikv.spec import parse_rank_every


@dataclass(frozen=True)
class ServeBenchConfig:
    """Policies x concurrency levels on one model; ``pool_requests`` full-cache requests' worth of
    slots for the capacity run (0 skips it); ``rank_every``: every server's and ``epikv generate``'s
    ``--rank-every`` (rho, issue 56: an evicting policy at tau = 1, so its pool holds K + 1 a request)."""

    model: str | None = None
    policies: tuple[str, ...] = ("full", "streaming", "epikv", "h2o")
    budget: int = 256
    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 2048
    rounds: int = 1
    pool_requests: int = 4
    capacity_waves: int = 1
    prompt_source: str = "gsm8k"
    threads: int | None = 2
    dtype: str = "float32"  # the server's and generate's --dtype (auto: bf16 where the CPU has it)
    timeout_s: float = 7200.0
    soak_s: float = 0.0  # > 0: the soak instead of the sweep (epikv.bench.serve.soak)
    soak_rows: int = 8
    rank_every: int | None = None

    def __post_init__(self) -> None:
        parse_rank_every(self.rank_every)
        if self.soak_s < 0 or self.soak_rows < 1:
            raise ValueError(f"soak_s must be >= 0 and soak_rows >= 1, got {self.soak_s}, {self.soak_rows}")
        if not self.policies or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("need some policies and concurrency levels >= 1")
        if self.max_tokens < 2 or self.budget < 1 or self.rounds < 1 or self.capacity_waves < 1:
            raise ValueError("max_tokens must be >= 2; budget, rounds and capacity_waves >= 1")


# A few minutes on an idle 2-core machine: two policies, short requests, a small K so that the
# capacity run shows the pool holding more evicting requests than full-cache ones.
QUICK = ServeBenchConfig(
    policies=("full", "streaming"),
    budget=64,
    concurrency=(1, 4),
    max_tokens=128,
    pool_requests=2,
)


@dataclass
class Server:
    policy: str
    port: int
    process: subprocess.Popen
    peak_rss_mb: float = 0.0
    log: Path = field(default_factory=Path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sample_rss(self) -> None:
        """Track the peak of the server's resident memory (VmHWM, Linux)."""
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)
        except OSError:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVE_LINE = "epikv serve: "  # how epikv.serve.cli starts its log line with the spec


def start_server(
    config: ServeBenchConfig, policy: str, kv_pool: int | None, folder: Path, extra: list[str] | None = None
) -> Server:
    port = _free_port()
    argv = [sys.executable, "-m", "epikv.cli", "serve", "--policy", policy, "--budget", str(config.budget)]
    argv += ["--port", str(port), "--max-tokens", str(config.max_tokens), "--max-waiting", "1024"]
    argv += ["--served-model-name", "bench"]
    if config.model is not None:
        argv += ["--model", config.model]
    if kv_pool is not None:
        argv += ["--kv-pool", str(kv_pool)]
    if config.threads is not None:
        argv += ["--threads", str(config.threads)]
    argv += ["--dtype", config.dtype, *_ranking(config), *(extra or [])]
    log = folder / f"server-{policy}-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads or os.cpu_count())}
    process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return Server(policy, port, process, log=log)


def _ranking(config: ServeBenchConfig) -> list[str]:
    return [] if config.rank_every is None else ["--rank-every", str(config.rank_every)]


def wait_ready(servers: list[Server], timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    for server in servers:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"server for {server.policy} exited: {server.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server for {server.policy} did not start in {timeout:.0f} s")
            time.sleep(0.5)


def server_spec(server: Server) -> dict[str, Any]:
    """The spec a started server runs, from the line ``epikv serve`` logs at start (its describe())."""
    for line in server.log.read_text().splitlines():
        if SERVE_LINE in line:  # after any progress-bar text on the same line
            described = line[line.index(SERVE_LINE) + len(SERVE_LINE) :].split(", model ")[0]
            return {"policy_name": server.policy, "describe": described}
    return {"policy_name": server.policy, "describe": f"policy={server.policy} (the server logged no spec)"}


def stop_servers(servers: list[Server]) -> None:
    for server in servers:
        server.process.terminate()
    for server in servers:
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()


def admitted_at_once(server: Server, pool: int, prompt_tokens: int, max_tokens: int) -> int:
    """How many requests the server's pool admits together: pool // (K + tau) for an evicting
    policy, pool // (prompt + max_tokens) for one that keeps everything (budget none)."""
    described = server_spec(server)["describe"]
    fields = dict(part.split("=", 1) for part in described.split() if "=" in part)
    if fields.get("budget", "none") == "none":
        return max(1, pool // (prompt_tokens + max_tokens))
    return max(1, pool // (int(fields["budget"]) + int(fields["interval"])))


async def capacity_level(server: Server, prompts: list[str], count: int, max_tokens: int) -> dict[str, Any]:
    """``count`` requests at once against a pooled server; the most that ran together (the server's
    own high-water mark of its running batch)."""
    import httpx

    level = await closed_loop(server.url, prompts, count, 1, max_tokens)
    server.sample_rss()
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{server.url}/metrics")).text
    peak = next(
        float(line.split()[1]) for line in text.splitlines() if line.startswith("epikv_running_rows_peak ")
    )
    return {**level, "max_running": int(peak)}


# --------------------------------------------------------------------------- the benchmark


def generate_speed(config: ServeBenchConfig, prompt: str) -> float:
    """Tokens/s of ``epikv generate`` (the same request, no server), for the serving overhead."""
    argv = [
        sys.executable,
        "-m",
        "epikv.cli",
        "generate",
        "--policy",
        "epikv",
        "--budget",
        str(config.budget),
    ]
    argv += [
        "--max-new-tokens",
        str(config.max_tokens),
        "--ignore-eos",
        "--json",
        "--dtype",
        config.dtype,
        *_ranking(config),
        prompt,
    ]
    if config.model is not None:
        argv += ["--model", config.model]
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads or os.cpu_count())}
    if config.threads is not None:
        argv += ["--threads", str(config.threads)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=config.timeout_s, env=env, check=True)
    return float(json.loads(done.stdout)["tokens_per_second"])


def run_serve(config: ServeBenchConfig, reporter: documents.Reporter | None = None) -> dict[str, Any]:
    """Sweep concurrency for every policy, then the capacity run; returns the document (the servers'
    logs go to a temporary folder, quoted in the error if one fails and removed after a success)."""
    reporter = reporter or documents.Reporter()
    if config.soak_s:
        return documents.make_document("serve", config, soak(config, reporter), specs=reporter.specs)
    folder = Path(tempfile.mkdtemp(prefix="epikv-bench-serve-"))
    prompts = prompt_loading.load_prompts(config.prompt_source, max(16, max(config.concurrency)), 0)
    load = [os.getloadavg()[0]]
    n = len(config.policies)  # one bar step per sweep level, capacity run and the generate run
    steps = n * len(config.concurrency) + (n if config.pool_requests else 0) + 1
    bar = reporter.bar(steps, "serve", unit="run")
    servers = [start_server(config, policy, None, folder) for policy in config.policies]
    try:
        wait_ready(servers)
        for server in servers:
            reporter.uses(server_spec(server))
        levels = sweep(config, servers, prompts, load, bar)
    finally:
        stop_servers(servers)
    longest = max(level["max_prompt_tokens"] for by_c in levels.values() for level in by_c.values())
    swept = prompts[: max(config.concurrency) * config.rounds]  # the prompts whose length was measured
    capacity = fixed_pool_run(config, swept, longest, folder, load, bar) if config.pool_requests else None
    overhead = None
    if "epikv" in config.policies and "1" in levels["epikv"]:
        bar.set_postfix_str("epikv generate")
        generated = generate_speed(config, prompts[0])
        overhead = {
            "generate_tokens_per_s": generated,
            "server_tokens_per_s": levels["epikv"]["1"]["tokens_per_s"],
        }
        overhead["ratio"] = overhead["server_tokens_per_s"] / generated
    bar.update()
    bar.close()
    results = {"levels": levels, "capacity": capacity, "overhead": overhead, "load_average": load}
    results["targets"] = serve_targets(results, config)
    shutil.rmtree(folder, ignore_errors=True)
    return documents.make_document("serve", config, results, specs=reporter.specs)


def soak(config: ServeBenchConfig, reporter: documents.Reporter) -> dict[str, Any]:
    """The soak (:mod:`epikv.bench.serve.soak`) against one server of the first policy."""
    folder = Path(tempfile.mkdtemp(prefix="epikv-bench-soak-"))
    server = start_server(config, config.policies[0], None, folder, soak_arguments(config.soak_rows))
    try:
        wait_ready([server])
        results = run_soak(config, reporter, server.url, server.process)
    finally:
        stop_servers([server])
    results["soak"]["traceback_in_server_log"] = "Traceback" in server.log.read_text()
    shutil.rmtree(folder, ignore_errors=True)
    return results


def sweep(
    config: ServeBenchConfig, servers: list[Server], prompts: list[str], load: list[float], bar: Any
) -> dict[str, dict[str, Any]]:
    """Every concurrency level on every server, the servers taking turns; one bar step per level."""
    levels: dict[str, dict[str, Any]] = {s.policy: {} for s in servers}
    for turn, clients in enumerate(config.concurrency):
        shift = turn % len(servers)
        for server in servers[shift:] + servers[:shift]:
            bar.set_postfix_str(f"{server.policy} x{clients}")
            level = asyncio.run(closed_loop(server.url, prompts, clients, config.rounds, config.max_tokens))
            server.sample_rss()
            levels[server.policy][str(clients)] = {**level, "peak_rss_mb": server.peak_rss_mb}
            load.append(os.getloadavg()[0])
            bar.update()
    return levels


def fixed_pool_run(
    config: ServeBenchConfig,
    prompts: list[str],
    prompt_tokens: int,
    folder: Path,
    load: list[float],
    bar: Any = None,
) -> dict[str, Any]:
    """One pool per policy, enough for ``pool_requests`` full-cache requests of the longest prompt
    seen in the sweep; more requests than fit are sent at once."""
    pool = config.pool_requests * (prompt_tokens + config.max_tokens)
    out: dict[str, Any] = {"kv_pool": pool, "policies": {}}
    for policy in config.policies:
        server = start_server(config, policy, pool, folder)
        try:
            wait_ready([server])
            admits = admitted_at_once(server, pool, prompt_tokens, config.max_tokens)
            count = admits * config.capacity_waves
            level = asyncio.run(capacity_level(server, prompts, count, config.max_tokens))
            out["policies"][policy] = {**level, "admits": admits, "peak_rss_mb": server.peak_rss_mb}
            load.append(os.getloadavg()[0])
        finally:
            stop_servers([server])
        if bar is not None:
            bar.update()
    return out


def serve_targets(results: dict[str, Any], config: ServeBenchConfig) -> dict[str, Any]:
    """The issue's targets beside what this run measured."""
    levels, top = results["levels"], str(max(config.concurrency))
    out: dict[str, Any] = {"measured_at": {"concurrency": int(top), "max_tokens": config.max_tokens}}
    if "epikv" in levels and "full" in levels:
        e, f = levels["epikv"][top], levels["full"][top]
        out["epikv_vs_full_tokens_per_s>=2"] = e["tokens_per_s"] / f["tokens_per_s"]
        out["epikv_p99_itl_no_worse_than_full"] = (e["itl_p99_s"] or 0) <= (f["itl_p99_s"] or 0)
    capacity = results.get("capacity")
    if capacity and "full" in capacity["policies"]:
        base = capacity["policies"]["full"]["tokens_per_s"]
        out["capacity_vs_full_tokens_per_s>=3"] = {
            p: v["tokens_per_s"] / base for p, v in capacity["policies"].items() if p != "full"
        }
        out["capacity_max_running"] = {p: v["max_running"] for p, v in capacity["policies"].items()}
    if results.get("overhead"):
        out["server_vs_generate_at_c1>=0.9"] = results["overhead"]["ratio"]
    return out


def plot_serve(json_path: str | os.PathLike[str], png: str | os.PathLike[str] | None = None) -> Path:
    """Tokens/s and p99 inter-token latency against concurrency (left, middle); capacity (right)."""
    data = documents.read_result(json_path, "serve")
    results, cfg = data["results"], data["config"]
    if "soak" in results:
        return plot_soak(results, Path(png or figures.png_path(json_path)))
    figure, axes = figures.new_figure(width=13.0, height=4.0, ncols=3)
    for index, (policy, levels) in enumerate(results["levels"].items()):
        xs = sorted(int(c) for c in levels)
        axes[0].plot(xs, [levels[str(c)]["tokens_per_s"] for c in xs], "o-", color=f"C{index}", label=policy)
        itl = [1000 * (levels[str(c)]["itl_p99_s"] or 0) for c in xs]
        axes[1].plot(xs, itl, "o-", color=f"C{index}", label=policy)
    for ax, label in ((axes[0], "aggregate tokens/s"), (axes[1], "p99 inter-token latency (ms)")):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    axes[0].set_title(f"K={cfg['budget']}, {cfg['max_tokens']} new tokens per request", fontsize=9)
    capacity = results.get("capacity")
    if capacity:
        names = list(capacity["policies"])
        running = [capacity["policies"][n]["max_running"] for n in names]
        speed = [capacity["policies"][n]["tokens_per_s"] for n in names]
        bars = axes[2].bar(names, speed, color=[f"C{i}" for i in range(len(names))])
        for bar, n in zip(bars, running, strict=True):
            top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
            axes[2].annotate(f"{n} at once", top, ha="center", va="bottom", fontsize=8)
        axes[2].set_ylabel("aggregate tokens/s")
        axes[2].set_title(f"capacity: KV pool of {capacity['kv_pool']} slots", fontsize=9)
    return figures.save_figure(figure, png or figures.png_path(json_path))
