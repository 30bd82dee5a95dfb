"""vLLM's own OpenAI server with the plugin, as a user starts it (separate engine and worker processes,
the plugin loaded by its entry point in each), on 127.0.0.1 and a free port; stops by itself
(``engines.serve``). It serves epikv's tiny Llama with the embedded model's tokenizer and chat
template (``conftest.tiny["served"]``): what is checked here is the server's wire format, counters,
refusals and faults, which do not depend on the weights, and its answers take seconds, not minutes."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.vllm.engines import metric, serve


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    args = ["--max-model-len", "4096", "--enable-prefix-caching", "--block-size", "32"]
    settings = {"policy": "epikv", "budget": 128, "interval": 16}  # answers past K + tau evict
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve(tiny["served"], args, settings, log, faults=True) as base:  # epikv_budget 77 fails
        yield base


def chat(base: str, content: str, max_tokens: int) -> httpx.Response:
    body = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def test_an_openai_client_gets_an_answer_with_bounded_memory_and_its_own_budget(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none")
    ask = [{"role": "user", "content": "Explain how a rainbow forms, step by step."}]
    replies = [
        client.chat.completions.create(
            model="smollm2",
            max_tokens=300,
            temperature=0,
            messages=ask,
            extra_body={"ignore_eos": True, **({"vllm_xargs": {"epikv_budget": k}} if k else {})},
        )
        for k in (None, 64)
    ]
    stats = [r.model_extra["kv_transfer_params"]["epikv"] for r in replies]
    assert all(r.choices[0].message.content for r in replies)
    assert [(s["budget"], s["peak_cache_tokens"]) for s in stats] == [(128, 128 + 16), (64, 64 + 16)]
    assert stats[1]["evictions"] > stats[0]["evictions"] > 0


def test_a_bad_budget_is_a_400_naming_it(server):
    """Also a request's own rho (``epikv_rank_every``), which a server at tau = 16 cannot take."""
    for field, value in (("epikv_budget", 100000), ("epikv_rank_every", 4)):
        body = {"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                "vllm_xargs": {field: value}}  # fmt: skip
        reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 400 and f"{field}={value}" in reply.text
        assert reply.json()["error"]["param"] == field


def test_a_streamed_refusal_is_a_400_before_any_stream_as_vllms_own_are(server):
    body = {
        "model": "smollm2",
        "max_tokens": 4,
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    answers = []
    for extra in ({"vllm_xargs": {"epikv_budget": 100000}}, {"temperature": -1.0}):  # epikv's, vLLM's
        with httpx.stream("POST", server + "/v1/chat/completions", json={**body, **extra}, timeout=60) as r:
            r.read()
            answers.append((r.status_code, r.headers["content-type"], json.loads(r.text)["error"]))
    assert [(status, kind) for status, kind, _ in answers] == [(400, "application/json")] * 2
    error = answers[0][2]
    assert error["param"] == "epikv_budget" and error["message"].startswith("epikv: epikv_budget=100000")


def test_a_request_the_plugin_fails_is_a_500_with_its_epikv_line_and_the_server_serves_on(server):
    """A fault in the worker (a request of budget 77 fails in its prefill: ``faults/``) may pass: it
    is vLLM's 500 for a request-level error, carrying the epikv line, streamed or not."""
    body = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            "vllm_xargs": {"epikv_budget": 77}}  # fmt: skip
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=300)
    error = reply.json()["error"]
    assert (reply.status_code, error["code"], error["type"]) == (500, 500, "InternalServerError")
    assert error["message"].startswith("epikv: request chatcmpl-")
    assert error["message"].endswith("prefill failed: RuntimeError: a fault for the test")
    with httpx.stream(
        "POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and events[-1]["error"]["code"] == 500
    assert events[-1]["error"]["message"].endswith("prefill failed: RuntimeError: a fault for the test")
    assert chat(server, "Hi", 4).status_code == 200


def test_beam_search_is_refused_in_one_line(server):
    body = {"model": "smollm2", "max_tokens": 4, "n": 2, "use_beam_search": True,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "beam search is not supported" in reply.text


def test_stop_strings_and_streams_carry_their_counters(server):
    ask = [{"role": "user", "content": "Explain how a rainbow forms, step by step."}]
    body = {"model": "smollm2", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "messages": ask}
    free = httpx.post(server + "/v1/chat/completions", json=body, timeout=300).json()
    text = free["choices"][0]["message"]["content"]
    stop = text[len(text) * 7 // 8 :][:12]  # past K + tau: the stopped answer has evicted
    body["stop"] = [stop]
    stopped = httpx.post(server + "/v1/chat/completions", json=body, timeout=300).json()
    assert (
        stopped["choices"][0]["finish_reason"] == "stop"
        and stop not in stopped["choices"][0]["message"]["content"]
    )
    assert stopped["kv_transfer_params"]["epikv"]["evictions"] > 0
    with httpx.stream(
        "POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishing = [c for c in chunks if any(ch.get("finish_reason") for ch in c["choices"])]
    assert len(finishing) == 1 and finishing[0]["kv_transfer_params"] == stopped["kv_transfer_params"]


def test_a_streamed_completion_carries_its_counters(server):
    body = {"model": "smollm2", "prompt": "The three states of water are", "max_tokens": 160,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    plain = httpx.post(server + "/v1/completions", json=body, timeout=300).json()
    assert plain["kv_transfer_params"]["epikv"]["evictions"] > 0
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishing = [c for c in chunks if any(ch.get("finish_reason") for ch in c["choices"])]
    assert len(finishing) == 1 and finishing[0]["kv_transfer_params"] == plain["kv_transfer_params"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


def test_a_streamed_chat_with_n_choices_carries_every_choices_counters_once(server):
    """n > 1 (sampled: vLLM refuses n > 1 with greedy), under eviction: exactly one finishing chunk
    carries every choice's counters (``epikv_choices``), as the non-streamed response does: the first
    one written once the whole request has finished (which one depends on the engine's steps)."""
    ask = [{"role": "user", "content": "Explain how a rainbow forms, step by step."}]
    body = {"model": "smollm2", "max_tokens": 160, "temperature": 0.8, "seed": 1, "ignore_eos": True,
            "n": 2, "messages": ask}  # fmt: skip
    plain = httpx.post(server + "/v1/chat/completions", json=body, timeout=300).json()
    choices = plain["kv_transfer_params"]["epikv_choices"]
    assert len(choices) == 2 and all(c["evictions"] > 0 for c in choices)
    with httpx.stream(
        "POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishing = [c for c in chunks if any(ch.get("finish_reason") for ch in c["choices"])]
    assert sorted(ch["index"] for c in finishing for ch in c["choices"] if ch.get("finish_reason")) == [0, 1]
    carried = [c["kv_transfer_params"] for c in finishing if "kv_transfer_params" in c]
    assert len(carried) == 1 and carried[0]["epikv_choices"] == choices  # lengths fix the counters


def test_a_shared_system_prompt_hits_the_prefix_cache_with_the_same_tokens(server):
    system = "You are a careful assistant. " * 10  # two full blocks of 32; Seg-Q@128 protects it
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Name a prime."}]
    body = {"model": "smollm2", "max_tokens": 160, "temperature": 0, "ignore_eos": True, "messages": ask}
    hits = [metric(server, "vllm:prefix_cache_hits_total")]
    answers = []
    for _ in range(2):
        answers.append(httpx.post(server + "/v1/chat/completions", json=body, timeout=300).json())
        hits.append(metric(server, "vllm:prefix_cache_hits_total"))
    assert hits[2] - hits[1] >= 64  # the second request found the prompt's full blocks
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert all(a["kv_transfer_params"]["epikv"]["evictions"] > 0 for a in answers)


def test_every_finished_request_is_counted_as_vllm_counts_it(server):
    chat(server, "Count to five.", 8)
    assert metric(server, "epikv:requests_total") == metric(server, "vllm:request_success_total") > 0
    assert "epikv:peak_cache_tokens_bucket" in httpx.get(server + "/metrics").text


def test_a_prompt_past_the_budget_runs_under_the_default_policy_keeping_its_prompt(server):
    """Issue 42 item 0: Seg-Q at K 128 cannot hold this prompt and its recent window; it runs at the
    smallest K that can (its counters say which), evicting what it generates past its window."""
    body = {"model": "smollm2", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "word " * 300}]}  # fmt: skip
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    stats, prompt = answer["kv_transfer_params"]["epikv"], answer["usage"]["prompt_tokens"]
    k = stats["budget"]
    assert k > 128 and prompt + min(128, k // 4) <= k and prompt + min(128, (k - 1) // 4) > k - 1
    assert stats["evictions"] > 0 and stats["peak_cache_tokens"] <= k + 16  # tau 16
    assert httpx.get(server + "/health").status_code == 200
