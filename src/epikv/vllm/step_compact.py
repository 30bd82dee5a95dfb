"""The worker step's compactions of due rows (:class:`RowCompactions`, an object held by
:class:`epikv.vllm.step.EpiKVWorkerState`): rows grouped by budget and scored in one call per group;
a group that raises is retried row by row and only the rows that raise again fail, so no row's
failure fails another row or another group. Under tensor parallelism each scoring call runs through
:meth:`epikv.vllm.compaction.HeadShards.together`, so every rank leaves a failing call at the same
collective and retries the same rows.

Under ``rank_every`` (issue 56; the server's, or a request's own ``epikv_rank_every``, which its
books keep) the due rows are split by the rule of epikv's engine
(:func:`epikv.cache.ranked.split_due`, each row by its own rho): the rows that score now compact as
above and keep their scores as their ranking; the others evict one token each from it
(:mod:`epikv.vllm.ranking`), with the same retries, faults, verdicts and counting (no policy call:
every rank holds the same ranking and picks the same victims).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import IO, Any, Protocol

import torch

from epikv.cache import ranked
from epikv.policies.rows import on_rows
from epikv.spec import CacheSpec
from epikv.vllm.compaction import Compaction, PagedView, SlotStore, choose
from epikv.vllm.ranking import choose_in_place
from epikv.vllm.requests import Requests

log = logging.getLogger("epikv.vllm.step")


class StepBatch(Protocol):
    """What a compaction reads of the step's batch (:class:`epikv.vllm.step.StepBatch`): each
    request's block ids."""

    blocks: Callable[[str], Sequence[int]] | None


class RowCompactions:
    """Compacting some rows of a step, an object the worker state holds: it owns the compaction's
    retries, counting and trace; the slot store and block size are the worker's, passed per call
    (the store exists only once vLLM has built the KV cache)."""

    def __init__(self, spec: CacheSpec, requests: Requests, trace: IO[str] | None) -> None:
        self.spec, self.requests, self.trace = spec, requests, trace

    def compact(
        self,
        store: SlotStore,
        block: int,
        batch: StepBatch,
        ids: list[str],
        books: Any,
        state: Any,
        rows: list[int],
    ) -> tuple[Any, dict[int, Exception]]:
        """Compact rows ``rows`` of a batch (``ids`` its request ids) whose slots are ``store``'s, in
        blocks of ``block``; returns the batch's state and the rows that failed, with what they
        raised. Rows of each budget are scored in one call, so a policy always sees one K (as in
        epikv's cache)."""
        failed: dict[int, Exception] = {}
        budgets, at = books.budgets, _Pass(store, block, batch, ids, books)
        scoring, in_place = ranked.split_due(self.spec, books, rows)
        for k in sorted({budgets[r] for r in scoring}):
            group = [r for r in scoring if budgets[r] == k]
            state = self._compact_group(at, state, group, failed, partial(self._choose, at, budget=k))
        if in_place:  # no policy call: every rank picks the same victims from the same ranking
            state = self._compact_group(at, state, in_place, failed, partial(self._in_place, at))
        return state, failed

    def _compact_group(
        self,
        at: _Pass,
        state: Any,
        rows: list[int],
        failed: dict[int, Exception],
        chooser: Callable[[list[int], Any], tuple[Compaction, Any]],
    ) -> Any:
        """Choose the group's compaction in one call (``chooser(rows, state)``), or each row's alone
        if that call raises (a row that raises alone fails), then do them."""
        chosen: list[tuple[list[int], Compaction]] = []
        try:
            done, state = _together(at.store, lambda: chooser(rows, state))
            chosen.append((rows, done))
        except Exception as err:
            for r in _alone(at.ids, rows, err, failed):
                try:
                    done, state = _together(at.store, lambda: chooser([r], state))  # noqa: B023
                    chosen.append(([r], done))
                except Exception as again:
                    log.exception("epikv: compaction of request %s failed alone too", at.ids[r])
                    failed[r] = again
        for group, done in chosen:
            self._apply(at, group, done, failed)
        return state

    def _choose(self, at: _Pass, rows: list[int], state: Any, budget: int) -> tuple[Compaction, Any]:
        """Score and select rows ``rows`` (one budget) in one call; nothing is written yet. When any
        of them ranks (its own rho or the server's) the call's scores are kept as the rows' ranking
        (one call, one ranking: a row that scores at every eviction never reads it)."""
        books, store = at.books, at.store
        held = [books.held[r] for r in rows]
        slots = _slot_rows(at, rows, max(held))
        view = PagedView(store, slots, torch.tensor(held), books.prompt_len[rows], books.seen[rows], budget)
        spec = self.spec
        rank = any(ranked.row_rank_every(spec, books, r) is not None for r in rows)
        return on_rows(state, rows, len(books), lambda part: choose(store, spec, part, view, rank))

    def _in_place(self, at: _Pass, rows: list[int], state: Any) -> tuple[Compaction, Any]:
        """Rows ``rows`` (``rank_every``) each evict one token from their ranking; nothing is written
        yet, and the policy's state is not read."""
        books = at.books
        held = [books.held[r] for r in rows]
        done = choose_in_place(
            at.store,
            self.spec,
            _slot_rows(at, rows, max(held)),
            torch.tensor(held),
            books.prompt_len[rows],
            books.seen[rows],
            [books.budgets[r] for r in rows],
            trace=self.trace is not None,
        )
        return done, state

    def _apply(self, at: _Pass, rows: list[int], done: Compaction, failed: dict[int, Exception]) -> None:
        """Do a chosen compaction of ``rows``; if it raises, do each row's part again alone (doing a
        part twice is doing it once), and fail the rows that raise again. Then count and trace. No
        collective: under tensor parallelism a row failed here on one rank is failed on every rank by
        the step's agreement that follows (:meth:`EpiKVWorkerState.agree`)."""
        ids, books = at.ids, at.books
        try:
            done.apply(at.store)
        except Exception as err:
            for i, r in enumerate(_alone(ids, rows, err, failed)):
                try:
                    done.row(i).apply(at.store)
                except Exception as again:
                    log.exception("epikv: moving request %s's tokens failed alone too", ids[r])
                    failed[r] = again
        for i, r in enumerate(rows):
            if r in failed:
                continue
            books.compacted([r], [done.kept[i]])
            if done.ranking is not None:
                ranked.mark_ranked(books, [r])
            self.requests.dropped[ids[r]] = int(books.evicted[r])
            if self.trace is not None:
                try:
                    record = {"request": ids[r], "seen": int(books.seen[r]), "kept": done.positions[i]}
                    self.trace.write(json.dumps(record) + "\n")
                    self.trace.flush()
                except Exception as err:  # a full disk, say: this row's line is lost, so it fails
                    log.exception("epikv: tracing request %s failed", ids[r])
                    failed[r] = err


@dataclass(frozen=True)
class _Pass:
    """One call's inputs that every step of it reads: the worker's slot store and block size, the
    step's batch, and the compacted batch's request ids and books."""

    store: SlotStore
    block: int
    batch: StepBatch
    ids: list[str]
    books: Any


def _slot_rows(at: _Pass, rows: list[int], width: int) -> torch.Tensor:
    """(b, width) the global slots of each of ``rows``' physical slots 0..width-1 (a row whose blocks
    hold fewer repeats its first slot: past its ``held``, never read as a token)."""
    batch, block = at.batch, at.block
    assert batch.blocks is not None
    out = []
    for r in rows:
        blocks = torch.tensor(list(batch.blocks(at.ids[r])), dtype=torch.long)
        row = (blocks[:, None] * block + torch.arange(block)).reshape(-1)[:width]
        out.append(torch.cat([row, row[:1].expand(width - row.shape[0])]))
    return torch.stack(out)


def _together(store: SlotStore, call: Any) -> Any:
    """``call()``, with one verdict on every rank under tensor parallelism."""
    return call() if store.shards is None else store.shards.together(call)


def _alone(ids: list[str], rows: list[int], err: Exception, failed: dict[int, Exception]) -> list[int]:
    """A call for ``rows`` raised ``err``: the rows to retry one at a time (none if it was one row's
    call: that row fails)."""
    if len(rows) == 1:
        log.exception("epikv: compaction of request %s failed", ids[rows[0]])
        failed[rows[0]] = err
        return []
    log.exception("epikv: compaction of %d requests failed; retrying each alone", len(rows))
    return rows
