"""What runs: one forward pass, and picking tokens from its logits.

The runner owns the model calls of the engine — a request's prefill into a cache of its own (in
chunks for a long prompt, with progress), one
decode forward for every row of the running batch, and a forced extension that returns every
position's logits — and token choice (greedy, or seeded temperature / nucleus sampling with one
generator per request). It holds the hooks (:class:`~epikv.integration.Attachment`) that feed the
caches and knows nothing of queues or requests' lifetimes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from epikv.cache import BudgetedCache
from epikv.engine.request import SamplingParams
from epikv.integration import Attachment
from epikv.integration.compat import cache_kwargs
from epikv.spec import CacheSpec

PREFILL_CHUNK = 2048
"""Prompt tokens per forward of a prefill: a longer prompt runs in chunks (bounded activation memory,
and progress to report; issue #12: 19,539 tokens ran 330 s in one silent forward)."""

ProgressCallback = Callable[[int, int], None]
"""Called after each chunk of a long prefill with (prompt tokens done, prompt tokens)."""


def prefill_pieces(length: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each forward of a prefill: full chunks, the first taking the remainder, so the
    last forward is a whole chunk (policies read the last prompt rows of their window there)."""
    first = length % chunk or chunk
    return [(0, first), *((start, start + chunk) for start in range(first, length, chunk))]


class Runner:
    """Model calls for one spec on one model."""

    def __init__(self, model: nn.Module, spec: CacheSpec, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.attachment = Attachment(model, spec)
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk

    def new_cache(self, budget: int | None = None, max_slots: int | None = None) -> BudgetedCache:
        return self.attachment.new_cache(budget, max_slots=max_slots)

    @torch.no_grad()
    def prefill(
        self,
        cache: BudgetedCache,
        ids: Sequence[int],
        on_progress: ProgressCallback | None = None,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run ``ids`` (one sequence) into ``cache``; the logits of the last position, (V,).

        A prompt longer than ``prefill_chunk`` runs in chunks that the cache and the policies see as
        one prefill (no compaction in between), giving what one forward gives; ``on_progress`` hears
        after each chunk. The rest of a prompt after a shared prefix extends the prefix's cache.
        ``on_logits`` hears (start, logits (q, V)) of every position of each chunk (logits_to_keep=0)."""
        ids = list(ids)
        pieces = prefill_pieces(len(ids), self.prefill_chunk)
        # A started cache is a prefix (full cache, no policy state): the rest extends it by plain steps.
        prompt = nullcontext() if cache.started else cache.chunked_prefill()
        with self.attachment, prompt:
            for start, end in pieces:
                input_ids = torch.tensor([ids[start:end]], dtype=torch.long, device=self.device)
                keep = 0 if on_logits is not None else 1
                out = self.model(
                    input_ids=input_ids,
                    use_cache=True,
                    **cache_kwargs(self.model, cache),
                    logits_to_keep=keep,
                )
                if on_logits is not None:
                    on_logits(start, out.logits[0])
                if on_progress is not None and len(pieces) > 1:
                    on_progress(end, len(ids))
        return out.logits[0, -1]

    @torch.no_grad()
    def extend(self, cache: BudgetedCache, ids: Sequence[int]) -> torch.Tensor:
        """Run ``ids`` (one sequence) into ``cache``; the logits of every position, (q, V)."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with self.attachment:
            out = self.model(input_ids=input_ids, use_cache=True, **cache_kwargs(self.model, cache))
        return out.logits[0]

    @torch.no_grad()
    def decode(self, cache: BudgetedCache, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row of ``cache``, (B,); the next logits, (B, V)."""
        with self.attachment:
            out = self.model(input_ids=tokens[:, None], use_cache=True, **cache_kwargs(self.model, cache))
        return out.logits[:, -1]


def pick(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row's logits (V,): argmax, or a draw from ``generator``."""
    if sampling.greedy or generator is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > sampling.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def new_generator(sampling: SamplingParams) -> torch.Generator | None:
    return None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
