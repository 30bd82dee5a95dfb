"""The budgeted KV cache: transformers cache layers over a preallocated KV arena, evicting by policy.

This module owns, per row of a batch: the budget K and its compaction schedule (a row compacts when
it holds more than K tokens and tau decode steps have passed since its last compaction, or since its
prefill when the policy says so, whatever the other rows do; under ``rank_every`` it evicts one token
in place between rankings: :mod:`epikv.cache.ranked`), each slot's true position, which slots are
real, the policy's per-token values and per-row state, and the counters users read
(:class:`~epikv.cache.books.RowBooks`). Storage is an :class:`~epikv.cache.arena.Arena`: a step
writes each row's new token at the row's next slot (or the slot it freed), a compaction moves the kept
slots to the front of their row, and nothing is concatenated. Rows can be taken out and joined between
steps (:meth:`BudgetedCache.keep_rows`, :meth:`BudgetedCache.append`): the engine's continuous
batching; a request is prefilled straight into its row (:meth:`BudgetedCache.row_cache`). It calls the
policy through two narrow calls (``observe`` each step, ``score`` at a compaction) and never branches
on a policy's type. It does not know the model: the integration module feeds it each step's new
tokens (:meth:`begin_step`) and signals (:meth:`end_step`); a prompt fed in several forwards is one
prefill inside :meth:`BudgetedCache.chunked_prefill`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache

from epikv.cache import ranked
from epikv.cache.arena import Arena, ArenaShape, Writes
from epikv.cache.books import RowBooks
from epikv.cache.layer import BudgetedLayer
from epikv.cache.view import SequenceStats, SlotView
from epikv.cache.window import WindowLayer, Windows, windows_for
from epikv.policies.base import ModelInfo, StepSignals
from epikv.policies.rows import cat_rows, on_rows, take_rows
from epikv.spec import CacheSpec

log = logging.getLogger(__name__)
QueryProjector = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def arena_shape(spec: CacheSpec, model: ModelInfo) -> ArenaShape:
    """Per-slot layout for a spec: the evicting layers' keys and values (sliding-window layers keep
    theirs in :mod:`epikv.cache.window`), positions per head and buffers as wide as the policy selects."""
    grain, evicting = spec.policy.granularity, len(model.cache_layers)
    heads = model.num_kv_heads if "head" in grain else 1
    layers = evicting if "layer" in grain else 1
    return ArenaShape(evicting, model.num_kv_heads, model.head_dim, heads, layers, heads)


def _book(name: str) -> Any:
    return property(lambda cache: getattr(cache.books, name), doc=f"The rows' ``{name}`` (RowBooks).")


class BudgetedCache(Cache):
    """A cache holding at most K real tokens per row after each of the row's compactions, and at most
    K + tau in between. The spec's budget None never evicts (the ``full`` policy); ``budget`` narrows
    this cache's K below the spec's (a request's own budget). ``max_slots`` caps the arena (rows x
    slots, a KV pool); ``dtype`` is the KV dtype (the model's unless set)."""

    def __init__(
        self,
        spec: CacheSpec,
        model: ModelInfo,
        budget: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_slots: int | None = None,
        arena: Arena | None = None,
        windows: Windows | None = None,
    ) -> None:
        self.spec = spec
        self.budget = spec.row_budget(budget)
        self.arena = arena or Arena(
            arena_shape(spec, model), dtype, torch.device(device), max_slots, model.window_slots
        )
        self.windows = windows or windows_for(model, self.arena)
        evicting = {layer: i for i, layer in enumerate(model.cache_layers)}
        self._length_layer = model.cache_layers[0]  # the layer whose width is the cache's length
        sliding = {layer: i for i, layer in enumerate(model.sliding_layers)}
        super().__init__(
            layers=[
                BudgetedLayer(self.arena, evicting[i])
                if i in evicting
                else WindowLayer(self.windows, sliding[i])
                for i in range(model.num_layers)
            ]
        )
        self.policy = spec.policy
        self.model = model
        self.project_queries: QueryProjector | None = None
        self.owner: Any = None  # the attachment whose hooks feed this cache
        self.reservation: int | None = None  # slots a fresh cache's rows will need (None = grow)
        self._clear()

    def _clear(self) -> None:
        self.state: Any = None
        self.books = RowBooks.empty(self.arena.device)
        self.width = 0
        self.compactions = 0
        self._writes = Writes(0, 0, 0)
        self._resize(0, 0)
        self._chunked = False  # inside chunked_prefill: the forwards feed one prompt
        self._started = False

    def reset(self) -> None:
        """Forget every row; the arena's storage is kept for the next rows."""
        if self.arena.allocated and self.batch_size:
            self.arena.clear_rows(slice(0, self.batch_size), 0, self.width)
        if self.windows is not None:
            self.windows.reset()
        self._clear()

    def _resize(self, rows: int, width: int) -> None:
        self.width = width
        for layer in self.layers:
            if isinstance(layer, BudgetedLayer):
                layer.resize(rows, width)

    # -- what the rest of epikv reads --------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._started

    @property
    def batch_size(self) -> int:
        return len(self.books)

    @property
    def in_prefill(self) -> bool:
        """Whether the next forward feeds prompt tokens (the first one, or a later chunk of a prompt)."""
        return not self.started or self._chunked

    @property
    def interval(self) -> int:
        return self.spec.interval

    @property
    def valid(self) -> torch.Tensor:
        """(B, width) bool: real slots of the live rectangle."""
        return self.arena.valid[: self.batch_size, : self.width]

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        b, w = self.batch_size, self.width
        return {name: buf[:, :b, :, :w] for name, buf in self.arena.buffers.items()}

    # The books users and the engine read, by their names on the cache.
    prompt_len = _book("prompt_len")
    seen = _book("seen")
    held = _book("held")
    since = _book("since")
    peak = _book("peak")
    evicted = _book("evicted")
    row_compactions = _book("compactions")

    @property
    def has_holes(self) -> bool:
        return any(h != self.width for h in self.books.held)

    def row_positions(self, row: int) -> torch.Tensor:
        """True positions of one row's slots in every layer, (layers, Hp, width); -1 at holes."""
        return self.arena.positions[:, row, :, : self.width]

    def stats(self) -> list[SequenceStats]:
        return self.books.stats()

    def kv_bytes(self) -> int:
        """Bytes of keys and values this cache has allocated (arena and sliding windows)."""
        return self.arena.kv_bytes() + (self.windows.arena.kv_bytes() if self.windows is not None else 0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots an evicting layer holds, whichever layer is asked (a sliding layer's ring is no length)."""
        return self.layers[self._length_layer].get_seq_length()

    def update(self, key_states, value_states, layer_idx: int, *args: Any, **kwargs: Any):
        kwargs["writes"] = self._writes
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    # -- rows (continuous batching): rows leave, join, and are prefilled in place -----------------
    def keep_rows(self, index: Sequence[int]) -> None:
        """Keep only rows ``index`` (in that order), freeing what the others held for reuse. Only rows
        that change place are copied (pass survivors moved into the gaps to copy the fewest)."""
        index = list(index)
        if not index:
            self.reset()
            return
        self.arena.keep_rows(index, self.batch_size, self.width)
        if self.windows is not None:
            self.windows.keep_rows(index)
        self.books = self.books.take(index)
        self.state = take_rows(self.state, index)
        self._resize(len(index), max(self.books.fill))

    def row_cache(
        self, budget: int | None = None, reserved: int | None = None, need: int = 1
    ) -> BudgetedCache:
        """An empty one-row cache over the next free row of this cache's arena, with room for ``need``
        slots (its prompt) and up to ``reserved`` as it grows: prefill it, then :meth:`append` it
        without a copy."""
        row = self.batch_size
        slots = self.arena.slots_for(max(need, self.width), [reserved, *self.books.reserved])
        self.arena.ensure(row + 1, slots, row, self.width)
        self.arena.clear_rows(slice(row, row + 1), 0, self.arena.slots)
        windows = self.windows.row_view(row) if self.windows is not None else None
        cache = type(self)(self.spec, self.model, budget, arena=self.arena.row_view(row), windows=windows)
        cache.reservation = reserved
        cache.project_queries, cache.owner = self.project_queries, self.owner
        return cache

    def append(self, other: BudgetedCache) -> None:
        """Join the rows of ``other`` (same spec, already prefilled) after this cache's rows."""
        if other.spec != self.spec:
            raise ValueError("only caches of one spec can share a batch")
        if not other.started:
            raise ValueError("a cache must be prefilled before it joins a batch")
        b, m = self.batch_size, other.batch_size
        slots = self.arena.slots_for(max(self.width, other.width), self.books.reserved + other.books.reserved)
        self.arena.ensure(b + m, slots, b, self.width)
        self.arena.append_rows(other.arena, m, b, other.width)
        if self.windows is not None:
            self.windows.append(other.windows)
        # Copies, never the other cache's objects: it may go on (a prefix, a benchmark's source row).
        rows = list(range(m))
        self.books = RowBooks.cat([self.books, other.books]) if b else other.books.take(rows)
        self.state = cat_rows([self.state, other.state]) if b else take_rows(other.state, rows)
        self._started = True
        self._resize(b + m, max(self.books.fill))

    def copy_prefix(self, length: int, into: BudgetedCache) -> None:
        """Fill the empty one-row cache ``into`` with this cache's first ``length`` slots, for a row that
        evicted nothing under a stateless policy (the full cache): a shared prompt prefix."""
        if self.windows is not None:
            raise ValueError(
                "a cache with sliding-window layers cannot share a prefix (its rings hold the last W)"
            )
        if self.batch_size != 1 or self.books.compactions[0] or self.state is not None or self.buffers:
            raise ValueError(
                "only a one-row cache that evicted nothing, without policy state, can be a prefix"
            )
        if not 0 < length <= self.books.held[0] or self.has_holes:
            raise ValueError(f"prefix length must be in 1..{self.books.held[0]}, got {length}")
        into.arena.ensure(1, into.arena.slots_for(length, [into.reservation]), 0, 0)
        into.arena.append_rows(self.arena, 1, 0, length)
        device = self.books.prompt_len.device
        into.books = RowBooks.holding(length, self.interval, into.budget, into.reservation, device)
        into.state, into._started = None, True
        into._resize(1, length)

    def prefix(self, length: int) -> BudgetedCache:
        """A new one-row cache (same hooks) holding this cache's first ``length`` slots (a copy)."""
        new = type(self)(self.spec, self.model, dtype=self.arena.dtype, device=self.arena.device)
        new.owner, new.project_queries = self.owner, self.project_queries
        self.copy_prefix(length, new)
        return new

    # -- step protocol used by the integration module -------------------------------------------
    def next_positions(self, new_valid: torch.Tensor) -> torch.Tensor:
        """True positions of the new tokens (B, q): tokens seen so far plus their rank; 0 at pads."""
        seen = self.seen if self.started else torch.zeros(new_valid.shape[0], dtype=torch.long)
        ranks = new_valid.long().cumsum(dim=-1) - 1
        return (seen.to(new_valid.device)[:, None] + ranks).clamp_min(0)

    def begin_step(self, new_valid: torch.Tensor, positions: torch.Tensor) -> None:
        batch, q = new_valid.shape
        decode = not self.in_prefill
        if not self.started:
            real = new_valid.sum(dim=-1)
            added = real.tolist()  # one host sync per prefill
            self.books = RowBooks.start(real, self.spec.first_since, self.budget, self.reservation)
            self._raise_budgets(added)
            self.state = self.policy.init_state(batch, self.model, new_valid.device)
            self._started = True
        else:  # later passes feed q real tokens to every row (the attention mask is ours)
            if self._chunked:  # a later chunk of the prompt: the prompt grows, nothing is decoded
                self.books.prompt_len = self.books.prompt_len + new_valid.sum(dim=-1)
                self._raise_budgets(self.books.prompt_len.tolist())  # one host sync per chunk
            added = [q] * batch
        self._write_slots(new_valid, positions, q)
        if self.windows is not None:
            seen = self.books.seen.to(positions.device) + new_valid.sum(dim=-1)
            self.windows.begin_step(new_valid, positions, seen)
        self.books.grow(added, q, decode=decode)

    def _raise_budgets(self, prompts: list[int]) -> None:
        """Each row's K for its prompt so far (:meth:`CacheSpec.prompt_budget`: raised where the
        prompt's protected tokens pass it), logged once per raise."""
        budgets = self.books.budgets
        for row, (tokens, k) in enumerate(zip(prompts, budgets, strict=True)):
            raised = self.spec.prompt_budget(tokens, k)
            if raised != k:
                log.info(
                    "row %d: a %d-token prompt's protected tokens pass K = %s; it runs at K = %s, "
                    "keeping its prompt and its newest tokens", row, tokens, k, raised,
                )  # fmt: skip
                budgets[row] = raised
        self.books.prompt = list(prompts)

    def _write_slots(self, new_valid: torch.Tensor, positions: torch.Tensor, q: int) -> None:
        """Choose each row's slots for the q new tokens, make room, and write positions and validity."""
        fills, batch, freed = self.books.fill, len(self.books.fill), self.books.freed
        width = max(f + (0 if r else q) for f, r in zip(fills, freed, strict=True))
        if batch > self.arena.rows or width > self.arena.slots:
            slots = self.arena.slots_for(width, self.books.reserved)
            self.arena.ensure(batch, slots, batch, self.width)
        if any(freed):  # rank_every: a row that evicted in place writes there, in each group and head
            self._writes = ranked.reuse_writes(self.arena, self.books, self.width, width)
            for layer in (x for x in self.layers if isinstance(x, BudgetedLayer)):
                layer.pending = width  # the mask is made before the layers write: no new column
        elif min(fills) == max(fills):
            self._writes = Writes(batch, width, q, fills[0])
        else:
            if q != 1:
                raise ValueError(f"rows at different lengths take one token per step, got {q}")
            rows = torch.arange(batch, device=positions.device)
            self._writes = Writes(batch, width, q, 0, torch.tensor(fills, device=positions.device), rows)
        pos = positions.masked_fill(~new_valid, -1).to(torch.int32)
        self.arena.write_tokens(self._writes, pos, new_valid)
        if ranked.RANK in self.arena.buffers:  # tokens newer than a row's ranking are unranked
            nan = torch.full((1, batch, 1, q), float("nan"), device=positions.device)
            self.arena.write_values(ranked.RANK, nan, self._writes)
        self.width = width  # the layers take it as each writes (until then they answer the old width)

    def end_step(self, signals: StepSignals) -> None:
        writes = self._writes
        old = self.width - writes.q if writes.before is None else writes.before
        signals.buffers = {name: buf[:, : writes.rows, :, :old] for name, buf in self.arena.buffers.items()}
        signals.slots_valid = self.valid
        signals.write_slots = writes.slots()
        for name, value in self.policy.observe(self.state, signals).items():
            self.arena.write_values(name, value, writes)
        self.books.seen = self.books.seen + signals.valid.sum(dim=-1)
        if self.windows is not None:
            self.windows.end_step()
        if not signals.prefill:
            self.books.since = [s + 1 for s in self.books.since]
        if not self._chunked:  # no compaction inside a prompt: its tokens are all protected or seen
            self._compact_due()

    @contextmanager
    def chunked_prefill(self) -> Iterator[None]:
        """The forwards inside feed one prompt into this empty cache in pieces (epikv.engine.runner),
        which the cache and the policies see as one prefill: the rows due compact after the last."""
        if self.started:
            raise ValueError("a chunked prefill feeds an empty cache (a prefix is extended by steps)")
        self._chunked = True
        try:
            yield
        finally:
            self._chunked = False
        self._compact_due()

    # -- compaction ----------------------------------------------------------------------------
    def _compact_due(self) -> None:
        rank, in_place = ranked.split_due(self.spec, self.books, self.books.due(self.interval))
        if rank:
            self.compact(rank)
        if in_place:  # rank_every: one token each, evicted in place (nothing moves)
            ranked.evict_in_place(self.arena, self.books, self.spec, in_place, self.width)
            self.compactions += 1

    def compact(self, rows: Sequence[int] | None = None) -> None:
        """Score, select and move ``rows`` (default: every row with a budget): the only place tokens
        leave the cache. Each budget among ``rows`` is scored in one call, so a policy always sees
        one K. Kept slots move to the front of their own row, in place; other rows are not touched."""
        budgets = self.books.budgets
        rows = sorted(r for r, k in enumerate(budgets) if k is not None) if rows is None else sorted(rows)
        if not rows:
            return
        groups = {k: [r for r in rows if budgets[r] == k] for k in sorted({budgets[r] for r in rows})}
        order = [r for group in groups.values() for r in group]
        index = torch.tensor(order, device=self.arena.valid.device)
        pick = slice(0, self.batch_size) if order == list(range(self.batch_size)) else index
        width, ranking = self.width, self.spec.rank_every is not None
        if ranking:  # a ranking sees its slots in positional order, as every compaction does
            ranked.sort_slots(self.arena, pick, width)
        scores = torch.cat([self._score(group, k) for k, group in groups.items()], dim=1)
        if ranking:  # and its scores are kept
            ranked.store_ranking(self.arena, self.books, order, pick, scores, width)
        sel = self.spec.select(
            scores,
            self.arena.positions[:, pick, :, :width],
            self.prompt_len[pick],
            self.seen[pick],
            self.arena.valid[pick, :width],
            [budgets[r] for r in order],
        )
        self.arena.keep_slots(pick, sel.index, sel.valid, sel.kept, width)
        self.books.compacted(order, sel.kept.tolist())
        self._resize(self.batch_size, max(self.books.fill))
        self.compactions += 1

    def _score(self, rows: list[int], budget: int) -> torch.Tensor:
        """The policy's scores for ``rows`` at one budget, (G, len(rows), H, L). The policy sees those
        rows only (and their state, written back after: scoring may advance it)."""
        view = SlotView(self, None if len(rows) == self.batch_size else rows, budget)
        scores, self.state = on_rows(self.state, rows, self.batch_size, lambda s: self.policy.score(s, view))
        return scores
