"""Log-probabilities over HTTP: with the full cache they equal a plain transformers forward over the
same tokens (the engine's own forwards, no second pass); chat and completions shapes, echo, streams."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from epikv.engine import Engine, Request, SamplingParams
from epikv.integration import build_spec
from tests.helpers.serve import MODEL_NAME, start, stop

PROMPT = "The quick brown fox jumps over the lazy dog. Then"


@pytest.fixture(scope="module")
def full(serve_model, embedded_tokenizer):
    server = start(serve_model, embedded_tokenizer, build_spec(serve_model, "full"), None, max_tokens=64)
    yield server
    stop(server)


def engine_tokens(model, ids: list[int], n: int) -> list[int]:
    """What the server's engine picks greedily, run here alone (the server yields the same, tested)."""
    return Engine(model, build_spec(model, "full")).run([Request(ids, n, SamplingParams())])[0].token_ids


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' own: one forward over the whole sequence, log_softmax, (len(ids), V)."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def post(live, route: str, **body):
    response = httpx.post(f"{live.url}/v1/{route}", json={"model": MODEL_NAME, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_echo_logprobs_equal_transformers(full, serve_model, embedded_tokenizer):
    tok = embedded_tokenizer
    ids = tok(PROMPT)["input_ids"]
    made = engine_tokens(serve_model, ids, 6)
    body = post(full, "completions", prompt=ids, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3,
                echo=True)  # fmt: skip
    lp = body["choices"][0]["logprobs"]
    reference = plain_logprobs(serve_model, ids + made)
    sequence = ids + made
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in sequence]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [float(reference[i - 1, sequence[i]]) for i in range(1, len(sequence))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    for i in (1, len(ids) - 1, len(ids), len(sequence) - 1):  # prompt, last prompt, first and last new
        values, best = reference[i - 1].topk(3)
        top = {
            tok.decode([t], skip_special_tokens=False): v
            for t, v in zip(best.tolist(), values.tolist(), strict=True)
        }
        top.setdefault(lp["tokens"][i], float(reference[i - 1, sequence[i]]))
        assert lp["top_logprobs"][i] == pytest.approx(top, abs=1e-4)
    text = body["choices"][0]["text"]
    assert text == PROMPT + tok.decode(made, skip_special_tokens=True)
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 6


def test_chat_logprobs_equal_transformers(full, serve_model, embedded_tokenizer):
    tok = embedded_tokenizer
    messages = [{"role": "user", "content": "Name a color."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    made = engine_tokens(serve_model, ids, 5)
    body = post(full, "chat/completions", messages=messages, max_tokens=5, temperature=0, ignore_eos=True,
                logprobs=True, top_logprobs=2)  # fmt: skip
    content = body["choices"][0]["logprobs"]["content"]
    reference = plain_logprobs(serve_model, ids + made)
    assert [c["token"] for c in content] == [tok.decode([t], skip_special_tokens=False) for t in made]
    got = [c["logprob"] for c in content]
    assert got == pytest.approx([float(reference[len(ids) - 1 + k, t]) for k, t in enumerate(made)], abs=1e-4)
    for k, entry in enumerate(content):
        values, best = reference[len(ids) - 1 + k].topk(2)
        assert [t["token"] for t in entry["top_logprobs"]] == [
            tok.decode([t], skip_special_tokens=False) for t in best.tolist()
        ]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry["bytes"] == list(entry["token"].encode("utf-8", errors="replace"))
    assert len(content) == body["usage"]["completion_tokens"] == 5


def test_streamed_chat_logprobs_are_the_whole_ones_in_pieces(full):
    messages = [{"role": "user", "content": "Count."}]
    args = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 1}  # fmt: skip
    whole = post(full, "chat/completions", **args)["choices"][0]["logprobs"]["content"]
    raw = httpx.post(f"{full.url}/v1/chat/completions", json={"model": MODEL_NAME, "stream": True,
                     "stream_options": {"include_usage": True}, **args}, timeout=60)  # fmt: skip

    chunks = [json.loads(e[6:]) for e in raw.text.split("\n\n") if e.startswith("data: {")]
    pieces = [
        c for ch in chunks for choice in ch["choices"] for c in (choice["logprobs"] or {}).get("content", [])
    ]
    assert pieces == whole
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_max_tokens_zero_echoes_the_prompt_only(full, serve_model, embedded_tokenizer):
    ids = embedded_tokenizer(PROMPT)["input_ids"]
    # lm-evaluation-harness sends the token ids as one prompt in a list (a batch of one)
    body = post(full, "completions", prompt=[ids], max_tokens=0, echo=True, logprobs=0, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == embedded_tokenizer.decode(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs=0: the token
    reference = plain_logprobs(serve_model, ids)
    expected = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "echo": True, "stream": True}, "echo"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
    ],
)
def test_completion_refusals(full, body, param):
    response = httpx.post(f"{full.url}/v1/completions", json={"model": MODEL_NAME, **body}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_streamed_completion_logprobs_and_usage(full):
    args = {
        "prompt": "Once upon a time",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    whole = post(full, "completions", **args)["choices"][0]
    raw = httpx.post(f"{full.url}/v1/completions", json={"model": MODEL_NAME, "stream": True,
                     "stream_options": {"include_usage": True}, **args}, timeout=60)  # fmt: skip
    chunks = [json.loads(e[6:]) for e in raw.text.split("\n\n") if e.startswith("data: {")]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for p in pieces for x in p["logprobs"][key]] == whole["logprobs"][key]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_echo_without_logprobs_runs_no_prompt_projection(full, monkeypatch):
    heard = []
    monkeypatch.setattr(full.worker.engine.runner, "prefill", _spy(full.worker.engine.runner.prefill, heard))
    body = post(full, "completions", prompt=PROMPT, max_tokens=0, echo=True)
    assert body["choices"][0]["text"] == PROMPT and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 0 and heard == [False]


def _spy(prefill, heard: list):
    def spied(cache, ids, on_progress=None, on_logits=None):
        heard.append(on_logits is not None)
        return prefill(cache, ids, on_progress, on_logits)

    return spied
