"""Per-request books and policy state inside vLLM's worker, keyed by request id, never by batch row.

vLLM's runner moves rows when requests finish or join (``condense``), so each request keeps its own
:class:`~epikv.cache.books.RowBooks` row and policy state. The decode rows of a step run as one
batch in the runner's row order; the batch is rebuilt only when that order changes (the same
take-rows/cat-rows protocol the epikv engine splices its rows with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.cache.books import RowBooks
from epikv.policies.base import ModelInfo
from epikv.policies.rows import cat_rows, take_rows
from epikv.spec import CacheSpec
from epikv.vllm.config import RequestPlan


@dataclass
class Record:
    """One request: its books (one row), its policy state (one row) and its cap (the most physical
    tokens it may hold: :attr:`RequestPlan.cap`)."""

    books: RowBooks
    state: Any
    cap: int


class Requests:
    """Every running request's record, and the decode batch in the runner's current row order."""

    def __init__(self, spec: CacheSpec, model: ModelInfo) -> None:
        self.spec, self.model = spec, model
        self.records: dict[str, Record] = {}
        self.dropped: dict[str, int] = {}  # logical - physical tokens, what the slot mapping subtracts
        self._order: list[str] = []
        self._books: RowBooks | None = None
        self._state: Any = None

    def add(
        self,
        req_id: str,
        prompt_tokens: int,
        plan: RequestPlan,
        cached: int = 0,
        rank_every: int | None = None,
    ) -> None:
        """A new request under ``plan``; ``cached`` prompt tokens are already in its blocks (a
        prefix-cache hit: held, seen, never evicted, since the policy protects the prompt);
        ``rank_every``: its rho (:func:`~epikv.vllm.config.request_rank_every`), kept on its books."""
        assert plan.cap is not None, "the plugin's books are for evicting requests"
        prompt = torch.tensor([prompt_tokens])
        books = RowBooks.start(prompt, self.spec.first_since, plan.budget, None, rank_every)
        if cached:
            books.grow([cached], cached, decode=False)
            books.seen = books.seen + cached
        state = self.spec.policy.init_state(1, self.model, torch.device("cpu"))
        self.records[req_id] = Record(books, state, plan.cap)
        self.dropped[req_id] = 0

    def remove(self, req_id: str) -> Record | None:
        """Forget a request; its final books (from the batch if it was decoding), or None."""
        if req_id not in self.records:
            return None
        self._sync()
        self.dropped.pop(req_id, None)
        return self.records.pop(req_id)

    def batch(self, req_ids: list[str]) -> tuple[RowBooks, Any]:
        """Books and state of ``req_ids`` as one batch, rows in that order."""
        if req_ids != self._order:
            self._sync()
            self._order = list(req_ids)
            records = [self.records[r] for r in req_ids]
            self._books = RowBooks.cat([r.books for r in records]) if records else None
            self._state = cat_rows([r.state for r in records]) if records else None
        assert self._books is not None
        return self._books, self._state

    def set_state(self, state: Any) -> None:
        """The batch's state after a step (observe may replace fields; scoring may advance it)."""
        self._state = state

    def _sync(self) -> None:
        """Write the batch's rows back into their records (before the batch changes)."""
        if self._books is None:
            return
        for row, req_id in enumerate(self._order):
            if req_id in self.records:
                cap = self.records[req_id].cap
                self.records[req_id] = Record(self._books.take([row]), take_rows(self._state, [row]), cap)
        self._order, self._books, self._state = [], None, None
