"""Per-head and per-layer selection through the cache: each head/layer keeps its own top-k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

import epikv
from epikv.integration.compat import cache_kwargs
from epikv.policies.base import CacheView, Policy, StepSignals

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60]])


@dataclass(frozen=True)
class HeadwiseAge(Policy):
    """Keeps, per (layer, head), the slots whose position has the best pseudo-random hash; the hash
    differs per head and layer, so kept sets must differ. Also accumulates a per-slot counter
    (replace-style buffer) to check that buffers follow the selection."""

    name: ClassVar[str] = "headwise-test"
    granularity: ClassVar[str] = "layer_head"

    def observe(self, state: Any, step: StepSignals) -> dict[str, torch.Tensor]:
        g, b, h = 4, step.valid.shape[0], 2
        old = step.buffers.get("count")
        q = step.valid.shape[1]
        new = torch.zeros(g, b, h, q)
        count = new if old is None else torch.cat([old + 1, new], dim=-1)
        return {"count": count}

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        pos = torch.stack([view.positions(i) for i in range(view.num_layers)]).float()  # (G, B, H|1, L)
        pos = pos.expand(-1, -1, 2, -1)
        salt = torch.arange(8.0).view(4, 1, 2, 1)
        return torch.sin(pos * 12.9898 + salt * 78.233) * 43758.5453 % 1.0


@pytest.mark.parametrize("steps", [30])
def test_layer_head_granularity(tiny_llama, steps):
    with epikv.attach(tiny_llama, HeadwiseAge(recent=3), budget=16) as cache:
        logits = tiny_llama(input_ids=PROMPT, **cache_kwargs(tiny_llama, cache), use_cache=True).logits
        for _ in range(steps):
            logits = tiny_llama(
                input_ids=logits[:, -1].argmax(-1, keepdim=True),
                **cache_kwargs(tiny_llama, cache),
                use_cache=True,
            ).logits
        kept = {
            (i, h): tuple(layer.positions[0, h].tolist())
            for i, layer in enumerate(cache.layers)
            for h in range(2)
        }
        seen = int(cache.seen[0])
        for positions in kept.values():
            assert len(positions) == 16 and list(positions) == sorted(positions)
            assert set(range(8)) <= set(positions) and set(range(seen - 3, seen)) <= set(positions)
        assert len(set(kept.values())) > 1, "all heads kept the same tokens"
        # a slot's counter = forward passes since the one that wrote it (the prompt shares one)
        for i in range(4):
            for h in range(2):
                pos = cache.layers[i].positions[0, h]
                assert cache.buffers["count"][i, 0, h].tolist() == (seen - 1 - pos.clamp_min(7)).tolist()
