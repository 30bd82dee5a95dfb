"""Keys, limits and the access log: 401 without the key (constant-time compare), 413 over the body
limit, 400 for deep JSON and long prompts, 408 and a freed row past the deadline, X-Request-Id."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from epikv.serve import Access, ServeLimits
from tests.helpers.serve import MODEL_NAME, start, stop

KEY = "sk-test-0123456789"
LIMITS = ServeLimits(max_body_bytes=4096, max_json_depth=8, max_prompt_tokens=40)


@pytest.fixture(scope="module")
def keyed(serve_model, embedded_tokenizer, spec):
    server = start(serve_model, embedded_tokenizer, spec, None, 16, serve_limits=LIMITS, access=Access(KEY))
    yield server
    stop(server)


def hi(**extra):
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


def post(server, body=None, key: str | None = KEY, headers: dict | None = None, **kwargs):
    headers = {**({"Authorization": f"Bearer {key}"} if key is not None else {}), **(headers or {})}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30, **kwargs)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong",
        f"Basic {KEY}",
        f"Bearer {KEY[:-1]}",
        f"Bearer {KEY}x",
        KEY,
        "Bearer sk-test-0123456788",
    ],
)
def test_v1_routes_need_the_key(keyed, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    for response in (
        httpx.post(f"{keyed.url}/v1/chat/completions", json=hi(), headers=headers),
        httpx.get(f"{keyed.url}/v1/models", headers=headers),
        httpx.get(f"{keyed.url}/v1/nothing", headers=headers),
    ):
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_key_opens_v1_and_health_metrics_stay_open(keyed):
    assert post(keyed, hi()).status_code == 200
    assert httpx.post(f"{keyed.url}/v1/chat/completions", json=hi(),
                      headers={"Authorization": f"bearer {KEY}"}).status_code == 200  # fmt: skip
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200
    reply = keyed.client(api_key=KEY).chat.completions.create(**hi())
    assert reply.usage.completion_tokens <= 3
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="nope").chat.completions.create(**hi())


def test_metrics_can_be_protected_and_access_is_validated():
    assert Access(KEY, protect_metrics=True).guards("/metrics") and not Access(KEY).guards("/metrics")
    assert not Access(KEY).guards("/health") and Access(KEY).guards("/v1/models")
    with pytest.raises(ValueError, match="protect_metrics"):
        Access(None, protect_metrics=True)
    with pytest.raises(ValueError, match=r"without spaces \(7 characters"):
        Access("two key")
    with pytest.raises(ValueError, match="max_body_bytes must be at least 1, got 0"):
        ServeLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="request_timeout_s must be positive"):
        ServeLimits(request_timeout_s=0)


def test_body_size_depth_and_prompt_limits(keyed):
    big = post(keyed, hi(user="x" * 5000))
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    # no Content-Length (a chunked body): cut off while it arrives
    chunked = post(keyed, key=KEY, content=iter([b'{"model": "', b"x" * 5000, b'"}']))
    assert chunked.status_code == 413
    deep = post(keyed, hi(stream_options={"a": [[[[[[[[1]]]]]]]]}))
    assert deep.status_code == 400 and "more than 8 deep" in deep.json()["error"]["message"]
    assert post(keyed, hi(stream_options={"a": [[[[[[1]]]]]]})).status_code == 200  # depth 8 passes
    long = post(keyed, hi(messages=[{"role": "user", "content": "word " * 50}]))
    assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
    assert long.json()["error"]["param"] == "messages"


def urllib_post(server, body, key: str | None = KEY) -> tuple[int, dict]:
    """POST with Python's urllib, which writes the whole body before it reads (and asks to close)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{server.url}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


@pytest.mark.parametrize(
    "body, key, status, code",
    [
        (b"x" * (10 << 20), KEY, 413, "request_too_large"),  # Content-Length over the limit
        (iter([b"x" * (1 << 20)] * 10), KEY, 413, "request_too_large"),  # chunked: cut off as it comes
        (b"x" * (10 << 20), None, 401, "invalid_api_key"),
    ],
    ids=["declared", "chunked", "no key"],
)
def test_a_client_that_writes_before_it_reads_gets_its_answer(keyed, body, key, status, code):
    started = time.monotonic()
    got, answer = urllib_post(keyed, body, key)  # was "connection reset by peer" for a 10 MB body
    assert (got, answer["error"]["code"]) == (status, code)
    assert time.monotonic() - started < 30
    assert post(keyed, hi()).status_code == 200  # and the server still serves


def test_past_the_deadline_the_row_is_freed_and_the_client_told(serve_model, embedded_tokenizer, spec):
    limits = ServeLimits(request_timeout_s=0.5)
    server = start(serve_model, embedded_tokenizer, spec, None, 4000, serve_limits=limits)
    try:
        body = hi(max_tokens=4000, ignore_eos=True)  # far longer than half a second on a CPU
        late = post(server, body, key=None)
        assert late.status_code == 408 and late.json()["error"]["code"] == "request_timeout"
        assert "deadline of 0.5 s" in late.json()["error"]["message"]
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        assert events[-1] == "data: [DONE]"
        engine = server.worker.engine
        assert engine.running == 0 and engine.reserved_slots == 0
        assert 'epikv_requests_total{outcome="deadline"} 2.0' in httpx.get(f"{server.url}/metrics").text
    finally:
        stop(server)


def test_one_access_line_per_request_with_the_request_id(keyed, caplog):
    caplog.set_level(logging.INFO, logger="epikv.serve.access")
    ok = post(keyed, hi(ignore_eos=True), headers={"X-Request-Id": "trace-42"})
    assert ok.headers["x-request-id"] == "trace-42"
    refused = post(keyed, hi(), key="bad", headers={"X-Request-Id": "bad id with spaces"})
    fresh = refused.headers["x-request-id"]
    assert fresh != "bad id with spaces" and len(fresh) == 32
    lines = {}
    deadline = time.monotonic() + 10  # the line is written as the response ends: wait for it
    while len(lines) < 2 and time.monotonic() < deadline:
        lines = {json.loads(r.message)["request_id"]: json.loads(r.message) for r in caplog.records
                 if r.name == "epikv.serve.access"}  # fmt: skip
        time.sleep(0.01)
    line = lines["trace-42"]
    assert line["status"] == 200 and line["outcome"] == "length" and line["path"] == "/v1/chat/completions"
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert line["peak_cache_tokens"] == ok.json()["usage"]["peak_cache_tokens"] and line["evictions"] == 0
    assert line["duration_s"] > 0
    assert lines[fresh]["status"] == 401 and lines[fresh]["outcome"] == "invalid_api_key"
