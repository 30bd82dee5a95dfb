"""A long prompt is prefilled in chunks that give what one forward gives, with progress (#12 item 11)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.engine.runner import prefill_pieces
from epikv.policies import policy_names
from tests.helpers.engine import FLOAT_SENSITIVE, Logits, spec_for

PROMPT = torch.randint(2, 97, (100,), generator=torch.Generator().manual_seed(5)).tolist()
CHUNK = 40  # pieces of 20, 40 and 40 tokens: the last is whole (policies read its last rows)


def test_pieces_cover_the_prompt_with_a_whole_last_chunk() -> None:
    assert prefill_pieces(100, 40) == [(0, 20), (20, 60), (60, 100)]
    assert prefill_pieces(80, 40) == [(0, 40), (40, 80)]
    assert prefill_pieces(7, 40) == [(0, 7)]


def run(model, name: str, chunk: int | None) -> tuple[object, Logits, list[tuple[int, int]]]:
    # K=160 holds the 100-token prompt with any protection; 90 new tokens force compactions.
    engine = Engine(model, spec_for(model, name, budget=160))
    if chunk is not None:
        engine.runner.prefill_chunk = chunk
    progress: list[tuple[int, int]] = []
    request = Request(
        PROMPT, 90, on_logits=Logits(), on_prefill=lambda done, total: progress.append((done, total))
    )
    return engine.run([request])[0], request.on_logits, progress


@pytest.mark.parametrize("name", policy_names())
def test_a_chunked_prefill_gives_what_one_forward_gives(tiny_llama, name: str) -> None:
    whole, whole_logits, none = run(tiny_llama, name, None)
    chunked, chunked_logits, progress = run(tiny_llama, name, CHUNK)
    assert none == [] and progress == [(20, 100), (60, 100), (100, 100)]
    torch.testing.assert_close(chunked_logits.rows[0], whole_logits.rows[0], atol=1e-5, rtol=1e-4)
    if name in FLOAT_SENSITIVE:  # see test_engine: K-means ties flip on last-bit differences
        first = whole_logits.evicted.index(True)
        for a, b in zip(whole_logits.rows[:first], chunked_logits.rows[:first], strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        return
    assert chunked.token_ids == whole.token_ids
    counters = ("compactions", "evictions", "peak_cache_tokens", "final_cache_tokens")
    assert [getattr(chunked, c) for c in counters] == [getattr(whole, c) for c in counters]
    assert whole.compactions > 0 or name == "full"


def same(a: object, b: object, where: str = "state") -> None:
    """Tensors close, everything else equal, through dataclasses, dicts and lists."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=where)
    elif isinstance(a, torch.Generator):
        assert torch.equal(a.get_state(), b.get_state()), where
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            same(a[key], b[key], f"{where}[{key}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("name", policy_names())
def test_the_cache_after_a_chunked_prefill_is_the_cache_after_one_forward(tiny_llama, name: str) -> None:
    caches = []
    for chunk in (4096, CHUNK):
        engine = Engine(tiny_llama, spec_for(tiny_llama, name, budget=160))
        engine.runner.prefill_chunk = chunk
        cache = engine.runner.new_cache()
        engine.runner.prefill(cache, PROMPT)
        caches.append(cache)
    whole, chunked = caches
    assert chunked.prompt_len.tolist() == [100] and not chunked.in_prefill
    for name_ in ("prompt_len", "seen", "valid", "held", "since", "peak", "evicted"):
        same(getattr(whole, name_), getattr(chunked, name_), name_)
    whole_buffers, chunked_buffers = dict(whole.buffers), dict(chunked.buffers)
    whole_state, chunked_state = whole.state, chunked.state
    ring = sorted(k for k in whole_buffers if k.rstrip("0123456789") != k)
    if ring:
        # SnapKV/R-KV keep the last w query rows in a ring whose slot is (rows written) mod w: the
        # chunks wrote more rows, so the same w rows sit rotated. Scoring reads the ring as a set.
        rows = [torch.stack([b.pop(k) for k in ring]) for b in (whole_buffers, chunked_buffers)]
        slot = torch.arange(rows[0].shape[-1], dtype=rows[0].dtype)
        order = [(r * slot).sum(dim=tuple(range(1, r.dim()))).argsort() for r in rows]  # by query
        same(rows[0][order[0]], rows[1][order[1]], "ring")
        whole_state = dataclasses.replace(whole_state, ring_count=chunked_state.ring_count)
    same(whole_buffers, chunked_buffers, "buffers")
    same(whole_state, chunked_state, "state")
    for mine, theirs in zip(whole.layers, chunked.layers, strict=True):
        same((mine.keys, mine.values, mine.positions), (theirs.keys, theirs.values, theirs.positions), "kv")
