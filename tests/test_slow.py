"""Long checks on the embedded model, behind the ``slow`` marker (``pytest -m slow``, minutes).

The default run checks the same properties on short decodes; these run the paper's default
operating point (EpiKV v3 at K=256, tau=128) long enough for several compactions per request.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    from epikv.models import load_model

    return load_model()


def test_long_staggered_batch_equals_each_request_alone(smol):
    from epikv.engine import Engine, Request
    from epikv.generation import encode_prompt_ids
    from epikv.integration import build_spec

    model, tok = smol
    prompts = ["Explain how a rainbow forms.", "Write a poem about the sea.", "What is 17 * 23?"]
    ids = encode_prompt_ids(tok, prompts)
    spec = build_spec(model, "epikv", 256)
    alone = [Engine(model, spec).run([Request(p, 600)])[0] for p in ids]
    engine, done, requests = Engine(model, spec), {}, [Request(p, 600) for p in ids]
    engine.add(requests[0])
    for step in range(2000):
        if step in (100, 250):
            engine.add(requests[1 if step == 100 else 2])
        done.update((c.request_id, c) for c in engine.step())
        if len(done) == 3:
            break
    for request, want in zip(requests, alone, strict=True):
        got = done[request.id]
        assert got.token_ids == want.token_ids
        assert got.compactions == want.compactions >= 2
        assert got.peak_cache_tokens == want.peak_cache_tokens <= 256 + 128


def test_server_on_the_embedded_model(smol):
    pytest.importorskip("fastapi")
    from concurrent.futures import ThreadPoolExecutor

    from epikv.engine import Engine, Request
    from epikv.generation import eos_ids
    from epikv.integration import build_spec
    from tests.helpers.serve import start, stop

    model, tok = smol
    spec = build_spec(model, "epikv", 128)
    questions = ["What is a prime number?", "Name a planet.", "Why is the sky blue?"]
    expected = []
    for q in questions:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        request = Request(
            tok(text, add_special_tokens=False)["input_ids"], 200, stop_ids=frozenset(eos_ids(model, tok))
        )
        expected.append(tok.decode(Engine(model, spec).run([request])[0].token_ids, skip_special_tokens=True))
    live = start(model, tok, spec, None, max_tokens=200)
    try:
        client = live.client()

        def ask(q: str) -> str:
            reply = client.chat.completions.create(
                model="tiny-serve", messages=[{"role": "user", "content": q}], max_tokens=200, temperature=0
            )
            return reply.choices[0].message.content

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, questions)) == expected
    finally:
        stop(live)
