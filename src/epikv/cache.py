"""The budgeted KV cache: transformers cache layers that keep true positions and evict by policy.

This module owns the budget K, the compaction interval tau, each slot's true position, which slots
are real (left padding and batch "holes" are not), the per-token values policies store, and the
counters users read (peak and final cached tokens, evictions, tokens seen). It calls the policy
through two narrow calls (``observe`` each step, ``score`` at a compaction) and never branches on a
policy's type. It does not know the model: the integration module feeds it each step's new tokens
(:meth:`BudgetedCache.begin_step`) and signals (:meth:`BudgetedCache.end_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from epikv.policies.base import ModelInfo, Policy, StepSignals
from epikv.selection import gather_slots, gather_tokens, protected_slots, select_keep

QueryProjector = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class BudgetedLayer(DynamicLayer):
    """A growing cache layer that also records the true position of every slot, (B, Hp, L) int32,
    where Hp is 1 unless the policy selects per head (then heads hold different tokens)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        positions = kwargs.pop("positions", None)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if positions is not None:
            new = positions[:, None, :]
            if self.positions is not None:
                new = torch.cat([self.positions, new.expand(-1, self.positions.shape[1], -1)], dim=-1)
            self.positions = new
        return keys, values

    def compact(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the slots ``index`` (B, 1 or H, k); ``valid`` (B, k) marks holes as False."""
        self.keys = gather_slots(self.keys, index)
        self.values = gather_slots(self.values, index)
        pos = self.positions.expand(-1, index.shape[1], -1).gather(-1, index.to(torch.long))
        self.positions = pos.masked_fill(~valid[:, None, :], -1)

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("beam search is not supported with a budgeted cache (its rows evict independently)")


@dataclass
class SequenceStats:
    """What the cache did to one sequence."""

    prompt_tokens: int
    tokens_seen: int
    peak_cache_tokens: int
    final_cache_tokens: int
    evictions: int


class BudgetedCache(Cache):
    """A cache holding at most ``budget`` real tokens per sequence after each compaction, and at most
    budget + interval in between. ``budget=None`` never evicts (the ``full`` policy)."""

    def __init__(
        self, policy: Policy, budget: int | None, model: ModelInfo, interval: int | None = None
    ) -> None:
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be a positive number of tokens, got {budget}")
        if interval is not None and interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        super().__init__(layers=[BudgetedLayer() for _ in range(model.num_layers)])
        self.policy = policy
        self.budget = budget if policy.evicts else None
        self.interval = interval if interval is not None else policy.interval
        self.model = model
        self.project_queries: QueryProjector | None = None
        self._clear()

    def _clear(self) -> None:
        self.state: Any = None
        self.valid: torch.Tensor | None = None
        self.prompt_len = self.seen = self.evicted = self.peak = torch.zeros(0, dtype=torch.long)
        self.buffers: dict[str, torch.Tensor] = {}
        self.compactions = 0
        self._pending: torch.Tensor | None = None
        self._held_max = 0  # host-side max real tokens held, so the decode step never syncs
        self._steps_since = self.interval
        self.has_holes = False

    def reset(self) -> None:
        super().reset()
        self._clear()

    @property
    def started(self) -> bool:
        return self.valid is not None

    def update(self, key_states, value_states, layer_idx: int, *args: Any, **kwargs: Any):
        kwargs["positions"] = self._pending
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    # -- step protocol used by the integration module -------------------------------------------
    def next_positions(self, new_valid: torch.Tensor) -> torch.Tensor:
        """True positions of the new tokens (B, q): tokens seen so far plus their rank; 0 at pads."""
        seen = self.seen if self.started else torch.zeros(new_valid.shape[0], dtype=torch.long)
        ranks = new_valid.long().cumsum(dim=-1) - 1
        return (seen.to(new_valid.device)[:, None] + ranks).clamp_min(0)

    def begin_step(self, new_valid: torch.Tensor, positions: torch.Tensor) -> None:
        batch, q = new_valid.shape
        if not self.started:
            device = new_valid.device
            self.prompt_len = new_valid.sum(dim=-1)
            self.seen = torch.zeros(batch, dtype=torch.long, device=device)
            self.evicted = torch.zeros_like(self.seen)
            self.peak = torch.zeros_like(self.seen)
            self._check_budget(int(self.prompt_len.max()))
            self.state = self.policy.init_state(batch, self.model, device)
            self.valid = new_valid.clone()
            self.has_holes = not bool(new_valid.all())
            self._held_max = int(self.prompt_len.max())
        else:
            self.valid = torch.cat([self.valid, new_valid], dim=-1)
            self._held_max += q
        self._pending = positions.masked_fill(~new_valid, -1).to(torch.int32)

    def end_step(self, signals: StepSignals) -> None:
        signals.buffers = self.buffers
        total = self.valid.shape[-1]
        for name, value in self.policy.observe(self.state, signals).items():
            old = self.buffers.get(name)
            if old is None or value.shape[-1] == total:
                self.buffers[name] = value
            else:
                self.buffers[name] = torch.cat([old, value.to(old.dtype)], dim=-1)
        self.seen = self.seen + signals.valid.sum(dim=-1)
        self.peak = torch.maximum(self.peak, self.valid.sum(dim=-1))
        if not signals.prefill:
            self._steps_since += 1
        if self.budget is not None and self._held_max > self.budget and self._steps_since >= self.interval:
            self.compact()

    def _check_budget(self, prompt_tokens: int) -> None:
        if self.budget is None:
            return
        recent = self.policy.recent_window(self.budget)
        needed = (prompt_tokens if self.policy.protect_prompt else self.policy.n_sink) + recent
        if needed > self.budget:
            what = "prompt" if self.policy.protect_prompt else f"{self.policy.n_sink} sinks"
            raise ValueError(
                f"budget {self.budget} cannot hold the protected tokens of policy {self.policy.name!r}: "
                f"{what} ({prompt_tokens if self.policy.protect_prompt else self.policy.n_sink}) + recent "
                f"window ({recent}) = {needed}; use --budget >= {needed}"
            )

    # -- compaction ----------------------------------------------------------------------------
    def compact(self) -> None:
        """Score, select and gather: the only place tokens leave the cache."""
        view = CacheView(self)
        scores = self.policy.score(self.state, view)
        positions = self._positions_for(scores)
        protected = protected_slots(
            positions,
            self.prompt_len,
            self.seen,
            protect_prompt=self.policy.protect_prompt,
            n_sink=self.policy.n_sink,
            recent=self.policy.recent_window(self.budget),
        )
        keep = torch.full_like(self.seen, self.budget)
        sel = select_keep(scores, protected, self.valid, keep)
        for i, layer in enumerate(self.layers):
            layer.compact(sel.index[i if sel.index.shape[0] > 1 else 0], sel.valid)
        self.buffers = {name: gather_tokens(buf, sel.index) for name, buf in self.buffers.items()}
        self.evicted = self.evicted + self.valid.sum(dim=-1) - sel.kept
        self.valid = sel.valid
        self.has_holes = not bool(sel.valid.all())
        self._held_max = int(sel.kept.max())
        self._steps_since = 0
        self.compactions += 1

    def _positions_for(self, scores: torch.Tensor) -> torch.Tensor:
        """Slot positions shaped like the scores' (G, B, H, L) layout."""
        if scores.shape[0] > 1:
            return torch.stack([layer.positions for layer in self.layers])
        return self.layers[0].positions[None]

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> list[SequenceStats]:
        held = self.valid.sum(dim=-1) if self.started else self.seen
        rows = zip(
            self.prompt_len.tolist(),
            self.seen.tolist(),
            self.peak.tolist(),
            held.tolist(),
            self.evicted.tolist(),
            strict=True,
        )
        return [SequenceStats(*row) for row in rows]


class CacheView:
    """The read-only view policies score from (implements ``epikv.policies.base.CacheView``)."""

    def __init__(self, cache: BudgetedCache) -> None:
        self._cache = cache
        self.budget = cache.budget
        self.num_layers = len(cache.layers)
        self.prompt_len = cache.prompt_len
        self.seen = cache.seen
        self.valid = cache.valid
        self.buffers = cache.buffers

    def keys(self, layer: int) -> torch.Tensor:
        return self._cache.layers[layer].keys

    def values(self, layer: int) -> torch.Tensor:
        return self._cache.layers[layer].values

    def positions(self, layer: int = 0) -> torch.Tensor:
        return self._cache.layers[layer].positions.long()

    def project_queries(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._cache.project_queries is None:
            raise RuntimeError("this cache is not attached to a model; queries cannot be recomputed")
        return self._cache.project_queries(layer, hidden, positions)
