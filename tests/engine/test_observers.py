"""What the engine lets a study observe: the kept positions at each compaction, the mean cache."""

from __future__ import annotations

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.integration import build_spec
from tests.helpers.engine import prompts


class Kept:
    """on_compaction recorder: (index, real positions per layer and head) per compaction."""

    def __init__(self) -> None:
        self.events: list[tuple[int, list[list[list[int]]]]] = []

    def __call__(self, index: int, positions: torch.Tensor) -> None:
        assert positions.dim() == 3  # (layers, heads, slots)
        real = [[[int(p) for p in head if p >= 0] for head in layer] for layer in positions]
        self.events.append((index, real))


def test_streaming_keeps_its_sinks_and_the_newest_tokens(tiny_llama):
    spec = build_spec(tiny_llama, "streaming", 12)  # 4 sinks + 8 recent, compacts every step
    prompt, kept = prompts()[0], Kept()  # 12 prompt tokens: the first compaction is one step later
    done = Engine(tiny_llama, spec).run([Request(prompt, 30, on_compaction=kept)])[0]
    assert len(kept.events) == done.compactions == 29
    for index, layers in kept.events:
        seen = len(prompt) + index
        want = [0, 1, 2, 3, *range(seen - 8, seen)]
        assert all(head == want for layer in layers for head in layer), index
    assert [index for index, _ in kept.events] == list(range(1, 30))


def test_a_row_compacted_at_prefill_per_head_joins_a_batch(tiny_llama):
    """A prompt longer than K compacts right after its prefill (reported at index 0); with a
    per-head policy its positions differ per head, and it still joins rows that hold one per slot."""
    spec = build_spec(tiny_llama, "h2o-head", 16)
    long, short = list(range(2, 30)), prompts()[1]
    observed = [Kept(), Kept()]
    batch = [Request(p, 12, on_compaction=k) for p, k in zip((short, long), observed, strict=True)]
    together = Engine(tiny_llama, spec).run(batch)
    for request, kept, got in zip(batch, observed, together, strict=True):
        alone_kept = Kept()
        want = Engine(tiny_llama, spec).run([Request(request.prompt_ids, 12, on_compaction=alone_kept)])[0]
        assert got.token_ids == want.token_ids
        assert kept.events == alone_kept.events and len(kept.events) == got.compactions
    assert observed[1].events[0][0] == 0  # the long prompt compacted at its prefill
    heads = observed[1].events[0][1][0]
    assert len(heads) == tiny_llama.config.num_key_value_heads and all(len(h) == 16 for h in heads)


def test_no_observer_no_reports(tiny_llama):
    spec = build_spec(tiny_llama, "streaming", 12)
    done = Engine(tiny_llama, spec).run([Request(prompts()[0], 20)])[0]
    assert done.compactions > 0  # nothing to call: a request without on_compaction costs nothing


@pytest.mark.parametrize(("policy", "budget"), [("full", None), ("streaming", 16)])
def test_mean_cache_tokens_is_the_cache_held_per_decode_step(tiny_llama, policy, budget):
    prompt, new = prompts()[3], 40  # 9 prompt tokens
    spec = build_spec(tiny_llama, policy, budget)
    done = Engine(tiny_llama, spec).run([Request(prompt, new, forced=list(range(2, 2 + new)))])[0]
    # decode passes feed tokens 0..new-2; after pass j the row holds the prompt + j tokens, capped
    # at K + 1 for a policy that compacts back to K at every step
    cap = float("inf") if budget is None else budget + 1
    held = [min(len(prompt) + j, cap) for j in range(1, new)]
    assert done.mean_cache_tokens == pytest.approx(sum(held) / len(held))
    assert done.peak_cache_tokens == max(held)
