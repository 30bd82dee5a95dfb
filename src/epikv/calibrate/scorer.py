"""The model-backed answer scorer for occlusion labelling, with a reusable prefix cache.

This module owns the forward passes of labelling: plain ``DynamicCache`` decoding, no eviction and no
hooks. The clean context (prompt + reasoning span) is run once per trace; each occluded variant then
starts from a copy of that cache cut at the first occluded position, so only the tail after the window
is recomputed (tokens before the window are unchanged, and causal attention means their keys and values
are too). Models with sliding-window layers recompute from scratch, since a cut sliding cache is not a
prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache


class ModelScorer:
    """:class:`epikv.calibrate.occlusion.AnswerScorer` over a Hugging Face causal LM."""

    def __init__(self, model: Any, reuse_prefix: bool = True) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.reuse_prefix = reuse_prefix and not _has_sliding_layers(model)
        self._clean: list[tuple[torch.Tensor, torch.Tensor]] = []

    def prepare(self, context: Sequence[int]) -> None:
        """Runs the clean context once and keeps its keys and values for later prefixes."""
        self._clean = []
        if not self.reuse_prefix:
            return
        cache = DynamicCache(config=self.model.config)
        self._forward(list(context), cache)
        self._clean = [(layer.keys, layer.values) for layer in cache.layers]

    def _prefix(self, length: int) -> DynamicCache:
        """A fresh cache holding the first ``length`` clean tokens (views: updates concatenate, so the
        clean tensors are never written)."""
        if length <= 0 or not self._clean:
            return DynamicCache(config=self.model.config)
        data = [(k[..., :length, :], v[..., :length, :]) for k, v in self._clean]
        return DynamicCache(ddp_cache_data=data, config=self.model.config)

    @torch.no_grad()
    def _forward(self, ids: list[int], cache: DynamicCache) -> torch.Tensor:
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(input_ids=input_ids, cache=cache, use_cache=True).logits[0].float()

    def _start(self, context: Sequence[int], unchanged: int) -> tuple[DynamicCache, int]:
        """Cache and position to resume from; at least the last context token is recomputed."""
        keep = min(unchanged, len(context) - 1) if self._clean else 0
        return self._prefix(keep), max(keep, 0)

    @torch.no_grad()
    def teacher_force(
        self, context: Sequence[int], answer: Sequence[int], unchanged: int
    ) -> tuple[np.ndarray, np.ndarray]:
        cache, keep = self._start(context, unchanged)
        tail = [*context[keep:], *answer[:-1]]
        logits = self._forward(tail, cache)[len(context) - keep - 1 :]
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(list(answer), dtype=torch.long, device=logp.device)
        chosen = logp.gather(-1, target[:, None])[:, 0]
        return chosen.cpu().numpy().astype(np.float64), logits.argmax(dim=-1).cpu().numpy()

    @torch.no_grad()
    def greedy(self, context: Sequence[int], max_new: int, stop: Sequence[int], unchanged: int) -> list[int]:
        cache, keep = self._start(context, unchanged)
        logits = self._forward(list(context[keep:]), cache)[-1]
        out: list[int] = []
        while len(out) < max_new:
            token = int(logits.argmax())
            out.append(token)
            if token in stop or len(out) == max_new:
                break
            logits = self._forward([token], cache)[-1]
        return out


def _has_sliding_layers(model: Any) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=model.config).layers)
