"""``lagkv``: LagKV, lag-relative key/value eviction (Liang, Zhang, Li, Li; arXiv 2504.04704).

Attention-free. After n_sink = 4 sinks, positions are cut into chunks of ``lag`` = 128; a chunk is
scored once the next chunk is complete, by how its keys and values spread after min-max
normalisation against that next ("lagging") chunk, per layer and KV head
(:func:`epikv.scoring.lag_chunk_scores`: std over channels, softmax within the chunk, K and V
averaged, ranked within the chunk). Chunks without a complete successor (the last full chunk and the
partial one) are not scored and are preferred over scored ones, as the original keeps them as its
sliding window.

Budget form: the original compresses each completed chunk by a fixed ratio; here chunks are fixed by
true position and every compaction re-scores the cached tokens of each chunk against the cached tokens
of its successor, and the rank within the chunk (divided by the chunk's cached count) makes one
global top-k take the same share of every chunk. Compaction every ``interval`` = lag steps (a chunk
completes every lag tokens). Protection: 4 sinks + the recent window r = min(128, K/4) (= lag at the
paper's budgets); the prompt is compressed like any other chunk, as in the original.

Not EpiKV's causal variant ``epikv-lag`` (previous-chunk reference, no softmax, one global mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.policies.base import CacheView, Policy
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class LagKV(Policy):
    """Lag-relative K/V spread against the next chunk, softmax and rank within chunks, per KV head."""

    name = "lagkv"
    summary = "LagKV: K/V spread normalised by the next chunk (lag 128), 4 sinks, per KV head."
    source = "https://arxiv.org/abs/2504.04704"
    granularity = "layer_head"

    interval: int = 128
    protect_prompt: bool = False
    n_sink: int = 4
    lag: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lag < 2:
            raise ValueError(f"{self.name}: lag must be >= 2, got {self.lag}")

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        out = []
        for layer in view.layers:
            keys = view.keys(layer)
            positions = view.positions(layer).expand(-1, keys.shape[1], -1)
            out.append(
                scoring.lag_chunk_scores(
                    keys, view.values(layer), positions, view.valid, view.seen, self.n_sink, self.lag
                )
            )
        return torch.stack(out)
