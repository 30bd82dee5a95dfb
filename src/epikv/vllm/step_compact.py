"""The worker step's compactions of due rows (:class:`RowCompactions`, an object held by
:class:`epikv.vllm.step.EpiKVWorkerState`): rows grouped by budget and scored in one call per group;
a group that raises is retried row by row and only the rows that raise again fail, so no row's
failure fails another row or another group. Under tensor parallelism each scoring call runs through
:meth:`epikv.vllm.compaction.HeadShards.together`, so every rank leaves a failing call at the same
collective and retries the same rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

import torch

from epikv.policies.rows import on_rows
from epikv.spec import CacheSpec
from epikv.vllm.compaction import Compaction, PagedView, SlotStore, choose
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
        budgets = books.budgets
        for k in sorted({budgets[r] for r in rows}):
            group = [r for r in rows if budgets[r] == k]
            state = self._compact_group(_Pass(store, block, batch, ids, books), state, group, k, failed)
        return state, failed

    def _compact_group(
        self, at: _Pass, state: Any, rows: list[int], budget: int, failed: dict[int, Exception]
    ) -> Any:
        """Choose the group's compaction in one call, or each row's alone if that call raises (a row
        that raises alone fails), then do them."""
        chosen: list[tuple[list[int], Compaction]] = []
        try:
            done, state = _together(at.store, lambda: self._choose(at, state, rows, budget))
            chosen.append((rows, done))
        except Exception as err:
            for r in _alone(at.ids, rows, err, failed):
                try:
                    done, state = _together(at.store, lambda: self._choose(at, state, [r], budget))  # noqa: B023
                    chosen.append(([r], done))
                except Exception as again:
                    log.exception("epikv: compaction of request %s failed alone too", at.ids[r])
                    failed[r] = again
        for group, done in chosen:
            self._apply(at, group, done, failed)
        return state

    def _choose(self, at: _Pass, state: Any, rows: list[int], budget: int) -> tuple[Compaction, Any]:
        """Score and select rows ``rows`` (one budget) in one call; nothing is written yet."""
        batch, ids, books, store = at.batch, at.ids, at.books, at.store
        assert batch.blocks is not None
        held = [books.held[r] for r in rows]
        width, block = max(held), at.block
        slot_rows = []
        for r in rows:
            blocks = torch.tensor(list(batch.blocks(ids[r])), dtype=torch.long)
            row = (blocks[:, None] * block + torch.arange(block)).reshape(-1)[:width]
            slot_rows.append(torch.cat([row, row[:1].expand(width - row.shape[0])]))
        view = PagedView(
            store,
            torch.stack(slot_rows),
            torch.tensor(held),
            books.prompt_len[rows],
            books.seen[rows],
            budget,
        )
        spec = self.spec
        return on_rows(state, rows, len(books), lambda part: choose(store, spec, part, view))

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
