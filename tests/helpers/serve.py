"""A live server on 127.0.0.1 (a free port) over a model, for the server tests: started in a
thread (:func:`start`, :func:`stop`) or waited for as a process (:func:`free_port`, :func:`wait_healthy`)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from epikv.engine import SchedulerLimits
from tests.helpers.models import SERVE_MODEL_NAME as MODEL_NAME


@dataclass
class Live:
    url: str
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def worker(self) -> Any:
        return self.app.state.worker

    def client(self, **kwargs: Any) -> Any:
        from openai import OpenAI

        kwargs = {"api_key": "none", "max_retries": 0, "timeout": 60, **kwargs}
        return OpenAI(base_url=f"{self.url}/v1", **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, process, output, seconds: float = 120) -> None:
    """Until the server process on ``port`` answers /health with 200; fails with the tail of its
    ``output()`` if it exits first, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, output()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def start(
    model: Any,
    tokenizer: Any,
    spec: Any,
    limits: SchedulerLimits | None,
    max_tokens: int = 256,
    **http: Any,
) -> Live:
    """``http``: build_app's serve_limits and access."""
    import uvicorn

    from epikv.serve import build_app

    app = build_app(model, tokenizer, spec, limits, MODEL_NAME, max_tokens, **http)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return Live(f"http://127.0.0.1:{port}", app, server, thread)


def stop(live: Live) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=15)
    assert not live.thread.is_alive(), "server did not stop"
