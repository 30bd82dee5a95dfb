"""A budgeted cache's per-row books: one row-state object that moves with its row.

Everything the cache counts per row lives here, host-side where a decision reads it (so the decode
step never waits on the device to decide anything): slots used (``fill``, padding included), real
tokens held, decode steps since the last compaction, the row's budget and reserved slots, and the
counters users read. Rows are taken and joined with the row protocol of
:mod:`epikv.policies.rows`, as policy state is, so no list is re-listed by hand when rows move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epikv.cache.view import SequenceStats
from epikv.policies.rows import RowState


@dataclass
class RowBooks(RowState):
    """Per-row counters; every field holds one entry per row.

    prompt_len, seen: (B,) real prompt tokens and real tokens seen; fill: slots used (a row's tokens
    sit in slots 0..fill-1); held: real tokens cached; since: decode steps since the row's last
    compaction; budgets: the row's K (None = never evicts); reserved: the most slots the row may
    use (None = unknown: the arena grows); peak, evicted, compactions: what users read; held_sum and
    passes: cached tokens summed over decode passes, and the passes (their ratio is the mean cache);
    prompt: ``prompt_len`` on the host; ranked: ``passes`` when the row last scored its cache under
    ``rank_every`` (None: it holds no ranking); freed: the row evicted a token in place and writes
    its next token into that slot (its fill stays); rank_every: the row's own rho (a vLLM request's
    ``epikv_rank_every``; None: its spec's, :func:`epikv.cache.ranked.row_rank_every`).
    """

    prompt_len: torch.Tensor
    seen: torch.Tensor
    fill: list[int]
    held: list[int]
    since: list[int]
    budgets: list[int | None]
    reserved: list[int | None]
    peak: list[int]
    evicted: list[int]
    compactions: list[int]
    held_sum: list[int]
    passes: list[int]
    prompt: list[int]
    ranked: list[int | None]
    freed: list[bool]
    rank_every: list[int | None]

    @classmethod
    def empty(cls, device: torch.device | None = None) -> RowBooks:
        zero = torch.zeros(0, dtype=torch.long, device=device)
        return cls(zero, zero.clone(), [], [], [], [], [], [], [], [], [], [], [], [], [], [])

    @classmethod
    def start(
        cls,
        prompt_len: torch.Tensor,
        since: int,
        budget: int | None,
        reserved: int | None,
        rank_every: int | None = None,
    ) -> RowBooks:
        """Books of rows about to take their first prefill (``prompt_len`` (B,) real prompt tokens):
        nothing held yet; the prefill's own pass adds its tokens (:meth:`grow`). ``rank_every``: the
        rows' own rho (None: the spec's)."""
        n = prompt_len.shape[0]
        zeros = [0] * n
        return cls(
            prompt_len=prompt_len.clone(),
            seen=torch.zeros_like(prompt_len),
            fill=list(zeros),
            held=list(zeros),
            since=[since] * n,
            budgets=[budget] * n,
            reserved=[reserved] * n,
            peak=list(zeros),
            evicted=list(zeros),
            compactions=list(zeros),
            held_sum=list(zeros),
            passes=list(zeros),
            prompt=prompt_len.tolist(),  # one host sync per prefill
            ranked=[None] * n,
            freed=[False] * n,
            rank_every=[rank_every] * n,
        )

    @classmethod
    def holding(
        cls, length: int, since: int, budget: int | None, reserved: int | None, device: torch.device
    ) -> RowBooks:
        """Books of one row that already holds a prompt of ``length`` tokens, none evicted and no pass
        decoded (a shared prompt prefix copied in)."""
        prompt = torch.full((1,), length, dtype=torch.long, device=device)
        books = cls.start(prompt, since, budget, reserved)
        books.seen = prompt.clone()
        books.grow([length], length, decode=False)
        return books

    def __len__(self) -> int:
        return len(self.fill)

    def grow(self, added: list[int], q: int, decode: bool) -> None:
        """A pass wrote ``q`` slots per row, ``added`` of them real (a row that had ``freed`` a slot
        wrote its one token there: its fill stays); a decode pass is counted."""
        self.fill = [f + (0 if r else q) for f, r in zip(self.fill, self.freed, strict=True)]
        self.freed = [False] * len(self.fill)
        self.held = [h + a for h, a in zip(self.held, added, strict=True)]
        self.peak = [max(p, h) for p, h in zip(self.peak, self.held, strict=True)]
        if decode:
            self.held_sum = [s + h for s, h in zip(self.held_sum, self.held, strict=True)]
            self.passes = [n + 1 for n in self.passes]

    def due(self, interval: int) -> list[int]:
        """Rows over their budget whose interval has passed since their last compaction."""
        rows = zip(self.held, self.since, self.budgets, strict=True)
        return [r for r, (h, s, k) in enumerate(rows) if k is not None and h > k and s >= interval]

    def compacted(self, rows: list[int], kept: list[int]) -> None:
        for r, k in zip(rows, kept, strict=True):
            self.evicted[r] += self.held[r] - k
            self.held[r] = self.fill[r] = k
            self.since[r] = 0
            self.compactions[r] += 1

    def evicted_in_place(self, rows: list[int]) -> None:
        """Rows ``rows`` each evicted one token and left its slot free for their next token."""
        for r in rows:
            self.evicted[r] += 1
            self.held[r] -= 1
            self.freed[r] = True
            self.since[r] = 0
            self.compactions[r] += 1

    def rank_due(
        self, rows: list[int], rank_every: list[int], first: list[int], recent: list[int]
    ) -> list[bool]:
        """Whether each of ``rows`` (over budget, by one token) scores its cache now under its
        ``rank_every``: it holds no ranking, the ranking is ``rank_every`` passes old, or no ranked
        token is left to evict. Its unranked tokens are its newest ``passes - ranked`` (each decode
        pass adds one), its protected ones the ``first`` (prompt or sinks) and the newest
        ``recent``; both tails and the first are all held, so the ranked tokens it may evict number
        held - first - max(recent, unranked) (they never overlap: a row over budget has generated
        more than ``recent`` tokens, since prompt + recent fits in K)."""
        out = []
        for r, rho, f, w in zip(rows, rank_every, first, recent, strict=True):
            ranked = self.ranked[r]
            age = None if ranked is None else self.passes[r] - ranked
            due = age is None or age >= rho or self.held[r] - f - max(w, age) < 1
            out.append(due)
        return out

    def stats(self) -> list[SequenceStats]:
        mean = [s / n if n else None for s, n in zip(self.held_sum, self.passes, strict=True)]
        rows = zip(
            self.prompt_len.tolist(),
            self.seen.tolist(),
            self.peak,
            self.held,
            self.evicted,
            mean,
            self.budgets,
            strict=True,
        )
        return [SequenceStats(*row) for row in rows]
