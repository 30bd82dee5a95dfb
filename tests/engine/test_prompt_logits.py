"""``Request.on_prompt_logits``: the prefill's own logits of every prompt position, chunked or not,
equal a plain forward of the model over the prompt (the server's echoed prompt log-probabilities)."""

from __future__ import annotations

import pytest
import torch

from epikv.engine import Engine, Request
from tests.helpers.engine import spec_for

PROMPT = torch.randint(2, 97, (50,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logits_equal_a_plain_forward(tiny_llama, chunk: int | None) -> None:
    engine = Engine(tiny_llama, spec_for(tiny_llama, "streaming", budget=64))
    if chunk is not None:
        engine.runner.prefill_chunk = chunk  # pieces of 2, 16, 16 and 16 tokens
    heard: list[tuple[int, torch.Tensor]] = []
    request = Request(PROMPT, 3, on_prompt_logits=lambda start, logits: heard.append((start, logits.clone())))
    done = engine.run([request])[0]
    assert [start for start, _ in heard] == ([0] if chunk is None else [0, 2, 18, 34])
    got = torch.cat([logits for _, logits in heard])
    with torch.no_grad():
        plain = tiny_llama(input_ids=torch.tensor([PROMPT])).logits[0]
    assert got.shape == plain.shape == (50, plain.shape[-1])
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-4)
    assert len(done.token_ids) == 3


def test_without_the_callback_the_prefill_keeps_one_position(tiny_llama) -> None:
    engine = Engine(tiny_llama, spec_for(tiny_llama, "full"))
    shapes: list[tuple[int, ...]] = []
    hook = tiny_llama.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.logits.shape)))
    try:
        engine.run([Request(PROMPT, 1)])
    finally:
        hook.remove()
    assert shapes == [(1, 1, shapes[0][-1])]
