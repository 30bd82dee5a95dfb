"""The model-backed answer scorer for occlusion labelling, with a reusable prefix cache.

This module owns the scoring passes of labelling, all on the full cache (no eviction) through the
engine: the clean context (prompt + reasoning span) is run once per trace; each occluded variant
then starts from that cache cut at the first occluded position (:meth:`BudgetedCache.prefix`), so
only the tail after the window is recomputed (tokens before the window are unchanged, and causal
attention means their keys and values are too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from epikv.cache import BudgetedCache
from epikv.engine import Engine, Request
from epikv.integration import build_spec


class ModelScorer:
    """:class:`epikv.calibrate.occlusion.AnswerScorer` over a Hugging Face causal LM."""

    def __init__(self, model: Any, reuse_prefix: bool = True) -> None:
        self.engine = Engine(model, build_spec(model, "full"))
        self.reuse_prefix = reuse_prefix
        self._clean: BudgetedCache | None = None

    def prepare(self, context: Sequence[int]) -> None:
        """Runs the clean context once and keeps its cache for later prefixes."""
        self._clean = None
        if self.reuse_prefix:
            self._clean = self.engine.runner.new_cache()
            self.engine.runner.prefill(self._clean, list(context))

    def _start(self, context: Sequence[int], unchanged: int) -> tuple[BudgetedCache, int]:
        """A cache holding the first ``keep`` context tokens and ``keep``; at least the last context
        token is recomputed."""
        keep = min(unchanged, len(context) - 1) if self._clean is not None else 0
        if keep <= 0:
            return self.engine.runner.new_cache(), 0
        return self._clean.prefix(keep), keep

    def teacher_force(
        self, context: Sequence[int], answer: Sequence[int], unchanged: int
    ) -> tuple[np.ndarray, np.ndarray]:
        cache, keep = self._start(context, unchanged)
        tail = [*context[keep:], *answer[:-1]]
        logits = self.engine.runner.extend(cache, tail)[len(context) - keep - 1 :].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(list(answer), dtype=torch.long, device=logp.device)
        chosen = logp.gather(-1, target[:, None])[:, 0]
        return chosen.cpu().numpy().astype(np.float64), logits.argmax(dim=-1).cpu().numpy()

    def greedy(self, context: Sequence[int], max_new: int, stop: Sequence[int], unchanged: int) -> list[int]:
        keep = min(unchanged, len(context) - 1) if self._clean is not None else 0
        request = Request(list(context[keep:]), max_new, stop_ids=frozenset(stop))
        if keep > 0:
            request.prefix, request.prefix_length = self._clean, keep
        return self.engine.run([request])[0].token_ids
