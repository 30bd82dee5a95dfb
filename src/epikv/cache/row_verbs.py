"""The budgeted cache's row verbs: rows leave, join and are prefilled in place (continuous batching).

A mixin of :class:`~epikv.cache.budgeted.BudgetedCache` (which owns the books, the policy state and
the arenas these verbs move): :meth:`RowVerbs.take_rows` keeps some rows, :meth:`RowVerbs.row_cache`
hands out the next free row to prefill a request into, :meth:`RowVerbs.append` joins prefilled rows,
and :meth:`RowVerbs.copy_prefix` / :meth:`RowVerbs.prefix` share a prompt prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from epikv.cache.books import RowBooks
from epikv.policies.rows import cat_rows, take_rows


class RowVerbs:
    """Row operations of a budgeted cache (mixed into BudgetedCache; ``self`` is one)."""

    spec: Any
    model: Any
    arena: Any
    windows: Any
    books: RowBooks
    state: Any
    width: int
    interval: int
    budget: int | None
    reservation: int | None
    project_queries: Any
    owner: Any
    batch_size: int
    buffers: dict[str, torch.Tensor]
    has_holes: bool
    started: bool

    # -- rows (continuous batching) ----------------------------------------------------------------
    def take_rows(self, index: Sequence[int]) -> None:
        """Keep only rows ``index`` (in that order), freeing what the others held for reuse. Only rows
        that change place are copied (pass survivors moved into the gaps to copy the fewest)."""
        index = list(index)
        if not index:
            self.reset()
            return
        moves = [(dst, src) for dst, src in enumerate(index) if dst != src]
        if moves:
            device = self.arena.valid.device
            dst = torch.tensor([m[0] for m in moves], device=device)
            src = torch.tensor([m[1] for m in moves], device=device)
            self.arena.copy_rows(dst, src, self.width)
        if len(index) < self.batch_size:
            self.arena.clear_rows(slice(len(index), self.batch_size), 0, self.width)
        if self.windows is not None:
            self.windows.take_rows(moves, len(index))
        self.books = self.books.take(index)
        self.state = take_rows(self.state, index)
        self._resize(len(index), max(self.books.fill))

    def row_cache(self, budget: int | None = None, reserved: int | None = None, need: int = 1) -> Any:
        """An empty one-row cache over the next free row of this cache's arena, with room for ``need``
        slots (its prompt) and up to ``reserved`` as it grows: prefill it, then :meth:`append` it
        without a copy."""
        row = self.batch_size
        slots = self._slots_for(max(need, self.width), [reserved, *self.books.reserved])
        self.arena.ensure(row + 1, slots, row, self.width)
        self.arena.clear_rows(slice(row, row + 1), 0, self.arena.slots)
        windows = self.windows.row_view(row) if self.windows is not None else None
        cache = type(self)(self.spec, self.model, budget, arena=self.arena.row_view(row), windows=windows)
        cache.reservation = reserved
        cache.project_queries, cache.owner = self.project_queries, self.owner
        return cache

    def append(self, other: Any) -> None:
        """Join the rows of ``other`` (same spec, already prefilled) after this cache's rows."""
        if other.spec != self.spec:
            raise ValueError("only caches of one spec can share a batch")
        if not other.started:
            raise ValueError("a cache must be prefilled before it joins a batch")
        b, m = self.batch_size, other.batch_size
        if not other.arena.is_view_of(self.arena, b):
            slots = self._slots_for(max(self.width, other.width), self.books.reserved + other.books.reserved)
            self.arena.ensure(b + m, slots, b, self.width)
            device = self.arena.valid.device
            dst = torch.arange(b, b + m, device=device)
            self.arena.copy_rows(dst, torch.arange(m, device=device), other.width, source=other.arena)
        if self.windows is not None:
            self.windows.append(other.windows)
        # Copies, never the other cache's objects: it may go on (a prefix, a benchmark's source row).
        rows = list(range(m))
        self.books = RowBooks.cat([self.books, other.books]) if b else other.books.take(rows)
        self.state = cat_rows([self.state, other.state]) if b else take_rows(other.state, rows)
        self._started = True
        self._resize(b + m, max(self.books.fill))

    def copy_prefix(self, length: int, into: Any) -> None:
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
        into.arena.ensure(1, into._slots_for(length, [into.reservation]), 0, 0)
        zero = torch.zeros(1, dtype=torch.long, device=self.arena.valid.device)
        into.arena.copy_rows(zero, zero, length, source=self.arena)
        books = self.books.take([0])
        books.prompt_len = torch.full_like(books.prompt_len, length)
        books.seen = torch.full_like(books.seen, length)
        books.fill, books.held, books.peak = [length], [length], [length]
        books.since, books.reserved = [self.interval], [into.reservation]
        books.budgets = [into.budget]
        into.books, into.state, into._started = books, None, True
        into._resize(1, length)

    def prefix(self, length: int) -> Any:
        """A new one-row cache (same hooks) holding this cache's first ``length`` slots (a copy)."""
        new = type(self)(self.spec, self.model, dtype=self.arena.dtype, device=self.arena.device)
        new.owner, new.project_queries = self.owner, self.project_queries
        self.copy_prefix(length, new)
        return new
