"""``streaming``: StreamingLLM's attention sinks plus the most recent window (arXiv 2309.17453)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.base import CacheView, Policy, global_scores
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Keep exactly the first n_sink tokens and the most recent K - n_sink; score nothing.

    Unlike the original, new tokens keep their true RoPE positions (the cache does this for every
    policy), and the prompt is not protected beyond the sinks.
    """

    name = "streaming"
    summary = "Attention sinks + sliding window of the most recent tokens."
    source = "https://arxiv.org/abs/2309.17453"

    protect_prompt: bool = False
    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.protect_prompt and self.recent is None:
            # The default window is K - n_sink: with the prompt protected too, no K holds both.
            raise ValueError(
                "streaming: protect_prompt=True with the default window (K - n_sink) protects more "
                "than K; use the policy streaming-prompt (the prompt and the newest tokens) or set recent"
            )

    def recent_window(self, budget: int) -> int:
        return budget - self.n_sink if self.recent is None else self.recent

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return global_scores(torch.full(view.valid.shape, float("-inf"), device=view.valid.device))
