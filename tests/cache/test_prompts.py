"""How a prompt enters a budgeted cache: in pieces inside one explicit chunked prefill, or copied
from a shared prefix, whose books are those of a row prefilled with the prefix alone."""

from __future__ import annotations

import pytest
import torch

from epikv.engine.runner import Runner
from epikv.integration import build_spec
from tests.helpers.engine import spec_for

PROMPT = torch.randint(2, 97, (100,), generator=torch.Generator().manual_seed(7)).tolist()


def prefilled(model, spec, chunk: int):
    runner = Runner(model, spec, prefill_chunk=chunk)
    cache = runner.new_cache()
    runner.prefill(cache, PROMPT)
    return cache


@pytest.mark.parametrize("name", ["streaming", "h2o", "h2o-head", "lagkv"])
def test_a_prompt_over_budget_compacts_once_after_its_last_piece(tiny_llama, name):
    spec = spec_for(tiny_llama, name, budget=48)  # the 100-token prompt is over K: due at once
    whole, chunked = prefilled(tiny_llama, spec, 4096), prefilled(tiny_llama, spec, 40)
    assert chunked.row_compactions == whole.row_compactions == [1]
    assert chunked.held == whole.held == [48] and chunked.evicted == [52]
    assert not chunked.in_prefill and chunked.since == whole.since == [0]
    assert torch.equal(chunked.row_positions(0), whole.row_positions(0))


def test_a_chunked_prefill_feeds_an_empty_cache_only(tiny_llama):
    spec = spec_for(tiny_llama, "h2o", budget=48)
    runner = Runner(tiny_llama, spec, prefill_chunk=40)
    cache = runner.new_cache()
    with pytest.raises(RuntimeError, match="boom"), runner.attachment, cache.chunked_prefill():
        assert cache.in_prefill
        raise RuntimeError("boom")
    assert not cache.started and cache.row_compactions == []  # closed without compacting
    runner.prefill(cache, PROMPT)
    with pytest.raises(ValueError, match="empty cache"), cache.chunked_prefill():
        pass


def test_a_prefix_rows_books_are_those_of_the_prefix_prefilled_alone(tiny_llama):
    runner = Runner(tiny_llama, build_spec(tiny_llama, "full"))
    source = runner.new_cache()
    runner.prefill(source, PROMPT)
    runner.decode(source, torch.tensor([5]))  # the source's own decode pass is not the prefix's
    alone = runner.new_cache()
    runner.prefill(alone, PROMPT[:30])
    prefix = source.prefix(30)
    assert torch.equal(prefix.row_positions(0), alone.row_positions(0))
    assert torch.equal(prefix.valid, alone.valid)
    for name in ("prompt_len", "seen", "fill", "held", "peak", "evicted", "compactions", "held_sum"):
        mine, theirs = getattr(prefix.books, name), getattr(alone.books, name)
        assert (mine.tolist() if isinstance(mine, torch.Tensor) else mine) == (
            theirs.tolist() if isinstance(theirs, torch.Tensor) else theirs
        ), name
    assert prefix.books.passes == [0] and prefix.stats() == alone.stats()
    assert prefix.books.since == [prefix.interval]  # a prefix row may compact at once
