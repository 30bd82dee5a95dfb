"""``streaming-prompt``: the whole prompt and the newest tokens, nothing scored.

The first equal-memory baseline of Random Attention (arXiv 2609.03430, 2026): every method runs at
K with the prompt kept and the same recent window, and this one fills the rest of K with the newest
tokens. It is StreamingLLM (``streaming``) with the prompt as its sink: ``streaming`` keeps 4 sinks
and the last K - 4 tokens, and ``protect_prompt=true`` on it would protect the prompt *and* K - 4
recent tokens, more than K. Here each slot's score is its true position, so the newest tokens win
whatever order the slots sit in, and the shared recent window r = min(128, K/4) is what every
policy protects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.base import CacheView, Policy
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class StreamingPrompt(Policy):
    """The prompt and the newest K - P tokens (newer kept first); no score is computed."""

    name = "streaming-prompt"
    summary = "The prompt + the newest tokens (StreamingLLM with the whole prompt kept); no score."
    source = "https://arxiv.org/abs/2609.03430"

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        newest = view.positions().float()  # (B, Hp, L): a slot's true position is its score
        return newest.masked_fill(~view.valid[:, None, :], float("-inf"))[None]
