"""Data parallelism: vLLM's OpenAI server with ``--data-parallel-size 2`` (two engine cores, each with
its own scheduler, worker and plugin) on 127.0.0.1 and a free port (``engines.serve``). Concurrent
chats are spread over both replicas; each is bounded by its own replica's plugin, and the plugin's
count of finished requests is vLLM's, over both. The model is epikv's tiny Llama with the embedded
model's tokenizer (``conftest.tiny["served"]``), as in ``test_serve.py``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.vllm.engines import metric, serve

K, N, REQUESTS = 64, 48, 8  # chat prompts of about 40 tokens: each evicts once past K


def test_two_replicas_each_bound_their_requests_and_every_finish_is_counted(tiny, tmp_path):
    args = ["--max-model-len", "1024", "--block-size", "32", "--data-parallel-size", "2",
            "--no-enable-prefix-caching"]  # fmt: skip
    with serve(tiny["served"], args, {"policy": "streaming", "budget": K}, tmp_path / "dp.log") as base:

        def chat(i: int) -> dict:
            ask = [{"role": "user", "content": f"Tell me fact number {i} about rivers."}]
            body = {
                "model": "smollm2",
                "max_tokens": N,
                "temperature": 0,
                "ignore_eos": True,
                "messages": ask,
            }
            reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            return reply.json()

        with ThreadPoolExecutor(REQUESTS) as pool:
            replies = list(pool.map(chat, range(REQUESTS)))
        served = [metric(base, "vllm:request_success_total", engine=str(e)) for e in (0, 1)]
        counted = metric(base, "epikv:requests_total")
        alone = [chat(i) for i in range(REQUESTS)]  # one at a time: each on one engine, by itself
    # spread over two replicas and batched there, each chat is what one engine gives it alone
    assert [r["choices"][0]["message"] for r in replies] == [r["choices"][0]["message"] for r in alone]
    peaks = [r["kv_transfer_params"]["epikv"]["peak_cache_tokens"] for r in replies]
    assert peaks == [K + 1] * REQUESTS, peaks
    assert min(served) >= 1 and sum(served) == REQUESTS  # both replicas served
    assert counted == REQUESTS  # counted before the chats alone
