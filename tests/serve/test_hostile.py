"""No input reaches a 5xx or a traceback: a fixed corpus of hostile bodies, then hypothesis-made ones,
against a live server with a key and small limits; every answer is a 4xx in the OpenAI error shape
(or, for a body that happens to be valid, a 200), and the server still serves afterwards."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from epikv.serve import Access, ServeLimits
from tests.helpers.serve import MODEL_NAME, start, stop

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]


class Errors(logging.Handler):
    """Every record at ERROR or above, from any logger (uvicorn logs a 500's traceback there)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def guarded(serve_model, embedded_tokenizer, spec):
    errors = Errors()
    logging.getLogger().addHandler(errors)
    limits = ServeLimits(max_body_bytes=256 * 1024, max_json_depth=16)
    server = start(serve_model, embedded_tokenizer, spec, None, 4, serve_limits=limits, access=Access(KEY))
    server.errors = errors
    yield server
    stop(server)
    logging.getLogger().removeHandler(errors)


def chat(**fields):
    return json.dumps({"model": MODEL_NAME, "messages": MSG, **fields}).encode()


def completion(**fields):
    return json.dumps({"model": MODEL_NAME, "prompt": "hi", **fields}).encode()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CORPUS: list[tuple[str, str, bytes, int]] = [
    ("nested arrays", CHAT, b"[" * 100_000 + b"]" * 100_000, 400),
    ("nested objects", CHAT, b'{"a":' * 20_000 + b"1" + b"}" * 20_000, 400),
    ("unclosed nesting", CHAT, b"[" * 5000, 400),
    ("nested in a field", CHAT, chat(stream_options={"x": json.loads("[" * 40 + "]" * 40)}), 400),
    ("too large", CHAT, b'{"x": "' + b"a" * 300_000 + b'"}', 413),
    ("empty", CHAT, b"", 400),
    ("null", CHAT, b"null", 400),
    ("array", CHAT, b"[]", 400),
    ("string", CHAT, b'"hello"', 400),
    ("invalid utf-8", CHAT, b'{"model": "\xff\xfe"}', 400),
    ("utf-8 bom", CHAT, b"\xef\xbb\xbf{}", 400),
    ("NaN", CHAT, chat()[:-1] + b', "temperature": NaN}', 400),
    ("Infinity", CHAT, chat()[:-1] + b', "top_p": -Infinity}', 400),
    ("huge integer", CHAT, chat()[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("huge float", CHAT, chat()[:-1] + b', "max_tokens": 1e400}', 400),
    ("lone surrogate", CHAT, chat()[:-1].replace(b'"hi"', b'"\\ud800"') + b"}", 400),
    ("seed overflow", CHAT, chat(seed=2**80), 400),
    ("seed negative overflow", CHAT, chat(seed=-(2**70)), 400),
    ("fractional max_tokens", CHAT, chat(max_tokens=1.5), 400),
    ("negative max_tokens", CHAT, chat(max_tokens=-3), 400),
    ("string max_tokens", CHAT, chat(max_tokens="lots"), 400),
    ("n huge", CHAT, chat(n=10**30), 400),
    ("bad role", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400),
    ("messages not a list", CHAT, chat(messages="hi"), 400),
    ("message not an object", CHAT, chat(messages=[1, 2]), 400),
    ("content parts not objects", CHAT, chat(messages=[{"role": "user", "content": [1]}]), 400),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400),
    ("stop not strings", CHAT, chat(stop=[1, 2]), 400),
    ("five stops", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400),
    ("empty stop", CHAT, chat(stop=""), 400),
    ("stream_options a string", CHAT, chat(stream_options="yes"), 400),
    ("include_usage a string", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400),
    ("logit_bias strings", CHAT, chat(logit_bias={"1": "x"}), 400),
    ("tools", CHAT, chat(tools=[{"type": "function"}]), 400),
    ("json mode", CHAT, chat(response_format={"type": "json_object"}), 400),
    ("top_logprobs alone", CHAT, chat(top_logprobs=3), 400),
    ("top_logprobs negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400),
    ("temperature huge", CHAT, chat(temperature=1e308), 400),
    ("top_p zero", CHAT, chat(top_p=0), 400),
    ("kv_budget zero", CHAT, chat(kv_budget=0), 400),
    ("kv_budget huge", CHAT, chat(kv_budget=10**12), 400),
    ("model a number", CHAT, chat(model=7), 400),
    ("unknown model", CHAT, chat(model="gpt-4"), 404),
    ("prompt over the context", CHAT, chat(messages=[{"role": "user", "content": "w " * 9000}]), 400),
    ("no prompt", COMPLETIONS, json.dumps({"model": MODEL_NAME}).encode(), 400),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400),
    ("empty id list", COMPLETIONS, completion(prompt=[[]]), 400),
    ("mixed prompt", COMPLETIONS, completion(prompt=[1, "a"]), 400),
    ("two prompts", COMPLETIONS, completion(prompt=["a", "b"]), 400),
    ("token id out of range", COMPLETIONS, completion(prompt=[2**40]), 400),
    ("negative token id", COMPLETIONS, completion(prompt=[[-5]]), 400),
    ("max_tokens 0 without echo", COMPLETIONS, completion(max_tokens=0), 400),
    ("echo streamed", COMPLETIONS, completion(echo=True, stream=True), 400),
    ("logprobs too many", COMPLETIONS, completion(logprobs=100), 400),
    ("suffix", COMPLETIONS, completion(suffix="x"), 400),
    ("best_of", COMPLETIONS, completion(best_of=3), 400),
]


@pytest.mark.parametrize("name, path, body, status", CORPUS, ids=[c[0] for c in CORPUS])
def test_every_hostile_body_gets_a_clean_4xx(guarded, name, path, body, status):
    response = httpx.post(f"{guarded.url}{path}", content=body, headers=AUTH, timeout=30)
    assert response.status_code == status, response.text[:300]
    assert_openai_error(response)


def test_wrong_methods_paths_and_headers_are_4xx_too(guarded):
    url = guarded.url
    for response in (
        httpx.get(f"{url}{CHAT}", headers=AUTH),
        httpx.put(f"{url}{COMPLETIONS}", headers=AUTH, content=b"{}"),
        httpx.post(f"{url}/v1/embeddings", headers=AUTH, content=b"{}"),
        httpx.post(f"{url}{CHAT}", content=chat()),  # no key
    ):
        assert 400 <= response.status_code < 500
        assert_openai_error(response)


def assert_openai_error(response: httpx.Response) -> None:
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] in ("invalid_request_error", "rate_limit_error")


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
          "stream_options", "n", "logprobs", "top_logprobs", "echo", "logit_bias", "kv_budget",
          "ignore_eos", "max_completion_tokens", "response_format"]  # fmt: skip
BODIES = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    st.fixed_dictionaries(
        {"model": st.just(MODEL_NAME), "messages": st.just(MSG)},
        optional={f: JSON for f in FIELDS if f not in ("model", "messages")},
    ),
    st.fixed_dictionaries({"model": st.just(MODEL_NAME), "prompt": JSON}),
)


@hypothesis.settings(max_examples=120, deadline=None, derandomize=True)
@hypothesis.given(body=BODIES, path=st.sampled_from([CHAT, COMPLETIONS]))
def test_hypothesis_bodies_never_reach_a_5xx(guarded, body, path):
    # a body that happens to be valid runs (max_tokens is at most 4 here): 200, or a stream
    response = httpx.post(f"{guarded.url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code < 500, response.text[:300]
    if response.status_code >= 400:
        assert_openai_error(response)


def test_no_traceback_and_still_serving(guarded):
    assert [r.getMessage() for r in guarded.errors.records] == []
    response = httpx.post(f"{guarded.url}{CHAT}", content=chat(max_tokens=2), headers=AUTH, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 2
    engine = guarded.worker.engine
    assert engine.running == 0 and engine.reserved_slots == 0
