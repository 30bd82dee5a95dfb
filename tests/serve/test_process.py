"""`epikv serve` as a process: a local model folder, SIGTERM while a stream is running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.helpers.serve import free_port, wait_healthy


def test_sigterm_drains_and_exits_within_seconds(serve_model_folder):
    folder = serve_model_folder
    port = free_port()
    argv = [sys.executable, "-m", "epikv.cli", "serve", "--model", str(folder), "--policy", "streaming"]
    argv += ["--budget", "64", "--port", str(port), "--drain-seconds", "2", "--served-model-name", "m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, server, lambda: server.stdout.read().decode())
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        received = 0
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    received += 1
                if received == 5:
                    sent = time.monotonic()
                    server.send_signal(signal.SIGTERM)
                    break
            try:
                for line in lines:  # the stream ends (drained or cut) instead of hanging
                    if line.startswith("data: {") and "error" in json.loads(line[6:]):
                        break
            except httpx.HTTPError:
                pass
        # uvicorn shuts down gracefully, then re-raises the signal: the exit status is SIGTERM's.
        assert server.wait(timeout=15) in (0, -signal.SIGTERM)
        assert time.monotonic() - sent < 2 + 5  # the drain time plus a few seconds
        log = server.stdout.read().decode()
        assert "Traceback" not in log, log[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
