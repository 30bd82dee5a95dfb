"""What the plugin does around each of vLLM's forward passes, inside the worker, on a plain step batch
(:class:`StepBatch`): this module knows no vLLM; :mod:`epikv.vllm.runner` reads vLLM's runner and
hands it over.

Before the forward (:meth:`EpiKVWorkerState.physical`): positions stay logical (RoPE sees true
positions), while each row's attention length and the slots its new tokens are written to become
physical (logical minus what the row has evicted); a row that would pass its cap or its blocks is a
fault of that request alone: its tokens are written nowhere and the request is failed by the
scheduler, never a write into someone else's block and never the engine's death.

After the forward (:meth:`EpiKVWorkerState.after_forward`): the new tokens' true positions are stored
beside their slots, the policy observes the band layers' hidden states (vLLM's own aux hidden
states), the books count the step, and each row that is due (held > its K and tau steps since its
last compaction: :meth:`RowBooks.due`) is compacted in place (:func:`epikv.vllm.compaction.choose`,
then :meth:`~epikv.vllm.compaction.Compaction.apply`). Whatever goes wrong for a request there
faults that request, with one line naming the cause; the step goes on for every other row. A
compaction that raises is retried per row and fails only the rows that raise alone; an exception
while observing a decode step (one call for the batch's shared state) fails the batch's rows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from epikv.policies.base import ModelInfo, StepSignals
from epikv.policies.rows import on_rows
from epikv.spec import CacheSpec
from epikv.vllm.compaction import Compaction, PagedView, SlotStore, choose
from epikv.vllm.config import EpiKVSettings, plan_request
from epikv.vllm.requests import Requests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewRequest:
    """A request the scheduler sent for the first time: ``prompt`` token count (None: embeddings),
    ``cached`` prompt tokens already computed (prefix-cache hit), its ``max_tokens`` and extra args."""

    req_id: str
    prompt: int | None
    cached: int
    max_tokens: int | None
    extra_args: Mapping[str, Any] | None


@dataclass
class StepBatch:
    """One step's rows as the plugin needs them (n rows, T scheduled tokens): request ids, tokens
    computed before this step, prompt lengths, tokens scheduled, query starts (n + 1,), physical
    slots each row's blocks hold (``room``), logical positions (T,), the slots written (T,; after
    the forward) and each request's block ids (for compaction)."""

    ids: list[str]
    computed: np.ndarray
    prompts: np.ndarray
    scheduled: np.ndarray
    starts: np.ndarray
    room: np.ndarray
    positions: torch.Tensor
    slots: torch.Tensor | None = None
    blocks: Callable[[str], Sequence[int]] | None = None


class EpiKVWorkerState:
    """The plugin's state in one worker: the spec, the requests' books and state, the slot store."""

    def __init__(
        self, settings: EpiKVSettings, spec: CacheSpec, model: ModelInfo, trace: bool = True
    ) -> None:
        self.settings, self.spec, self.model = settings, spec, model
        self.cap = spec.cap_tokens(0)  # K + tau: what a request with a prompt of at most K holds
        hidden = spec.policy.needs().hidden_layers
        # aux hidden state i+1 is decoder layer i's output (hidden + residual), i.e. HF's layer output
        self.aux_layers = tuple(sorted({layer + 1 for layer in hidden}))
        self.requests = Requests(spec, model)
        self.store: SlotStore | None = None
        self.block_size = 0
        # req_id -> (peak physical tokens, tokens evicted, compactions, budget) after this step
        self.report: dict[str, tuple[int, int, int, int | None]] = {}
        self.faults: dict[str, str] = {}  # req_id -> why, this step (the scheduler fails them)
        # one trace per engine: under tensor parallelism the first rank writes it (all keep the same)
        self._trace = open(settings.trace, "a") if settings.trace and trace else None

    @property
    def evicts(self) -> bool:
        return self.spec.budget is not None

    def fault(self, req_id: str, why: str) -> None:
        """This request cannot go on: forget it here; the scheduler finishes it with an error."""
        log.warning("epikv: request %s: %s", req_id, why)
        self.faults[req_id] = why
        self.requests.remove(req_id)

    def take(self) -> tuple[dict[str, tuple[int, int, int, int | None]], dict[str, str]]:
        """This step's counters and faults, for the runner's output (then cleared)."""
        report, faults = self.report, self.faults
        self.report, self.faults = {}, {}
        return report, faults

    # -- request lifecycle ------------------------------------------------------------------------
    def before_update(self, finished: Sequence[str], preempted: Sequence[str]) -> None:
        """Forget finished requests; a preempted or resumed one (the scheduler fails those under an
        evicting policy) is faulted if it is still here."""
        for req_id in finished:
            self.requests.remove(req_id)
        for req_id in preempted:
            if req_id in self.requests.records:
                self.fault(req_id, "preempted; an evicting request cannot be re-prefilled")

    def after_update(self, new: Sequence[NewRequest]) -> None:
        if not self.evicts:
            return
        for req in new:
            if req.prompt is None:
                self.fault(req.req_id, "prompt embeddings are not supported")
                continue
            try:
                plan = plan_request(self.spec, req.prompt, req.max_tokens, req.extra_args)
            except ValueError as err:
                self.fault(req.req_id, str(err))
                continue
            self.requests.add(req.req_id, req.prompt, plan, req.cached)

    # -- before the forward -----------------------------------------------------------------------
    def physical(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
        """Per row: tokens evicted so far (what attention lengths and slots subtract), and whether
        the row is faulted (its tokens must be written nowhere)."""
        n = len(batch.ids)
        dropped = np.zeros(n, dtype=np.int64)
        caps = np.zeros(n, dtype=np.int64)
        bad = np.zeros(n, dtype=bool)
        for i, req_id in enumerate(batch.ids):
            record = self.requests.records.get(req_id)
            if record is None:
                bad[i] = True
            else:
                dropped[i], caps[i] = self.requests.dropped[req_id], record.cap
        held_after = batch.computed - dropped + batch.scheduled
        over = ~bad & (held_after > np.minimum(batch.room, caps))
        for i in np.flatnonzero(over):
            self.fault(
                batch.ids[i],
                f"would hold {held_after[i]} tokens, past its cap of {caps[i]} (or its "
                f"{batch.room[i]} reserved slots)",
            )
        return dropped, bad | over

    # -- after the forward ------------------------------------------------------------------------
    def after_forward(self, batch: StepBatch, aux: list[torch.Tensor] | None) -> None:
        """Store the new tokens' positions, let the policy observe, count, and compact due rows."""
        n, starts = len(batch.ids), batch.starts
        if not self.evicts:  # ``full``: nothing to observe; the counters are the lengths
            held = (batch.computed + batch.scheduled).tolist()
            self.report.update((r, (h, 0, 0, None)) for r, h in zip(batch.ids, held, strict=True))
            return
        assert self.store is not None and batch.slots is not None
        total = int(starts[n])
        slots, positions = batch.slots[:total], batch.positions[:total]
        live = slots >= 0
        self.store.write(slots[live], positions[live])
        hidden = dict(zip([a - 1 for a in self.aux_layers], aux or [], strict=True))
        records = self.requests.records
        decode = []
        for i, req_id in enumerate(batch.ids):
            if req_id not in records:
                continue
            if batch.computed[i] >= batch.prompts[i]:
                decode.append(i)
                continue
            lo, hi = int(starts[i]), int(starts[i + 1])
            done = batch.computed[i] + hi - lo >= batch.prompts[i]
            try:
                self._prefill(batch, req_id, hidden, slots[lo:hi], positions[lo:hi], hi - 1, done)
            except Exception as err:  # this request's fault, not the engine's
                log.exception("epikv: prefill of request %s failed", req_id)
                self.fault(req_id, f"prefill failed: {type(err).__name__}: {err}")
        if decode:
            ids = [batch.ids[i] for i in decode]
            last = torch.from_numpy(starts[1:][decode] - 1)
            try:
                self._decode(batch, ids, hidden, slots[last], positions[last], last)
            except Exception as err:  # observing is one call on the rows' shared state: all fail
                log.exception("epikv: a decode step of %d requests failed", len(ids))
                for req_id in ids:
                    self.fault(req_id, f"decode step failed: {type(err).__name__}: {err}")

    def _prefill(
        self,
        batch: StepBatch,
        req_id: str,
        hidden: dict[int, torch.Tensor],
        slots: torch.Tensor,
        positions: torch.Tensor,
        last: int,
        done: bool,
    ) -> None:
        """A prompt chunk of one request: the policy sees its last state (epikv's prefill signal)."""
        record = self.requests.records[req_id]
        q = slots.shape[0]
        signals = StepSignals(
            hidden={layer: h[None, last : last + 1] for layer, h in hidden.items()},
            valid=torch.ones(1, q, dtype=torch.bool),
            positions=positions[None],
            prefill=True,
        )
        for name, value in self.spec.policy.observe(record.state, signals).items():
            self.store.write_buffer(name, slots, value[:, 0].transpose(1, 2))  # type: ignore[union-attr]
        record.books.grow([q], q, decode=False)
        record.books.seen = record.books.seen + q
        if done and record.books.due(self.spec.interval):
            record.state, failed = self._compact(batch, [req_id], record.books, record.state, [0])
            if failed:  # one row: the prefill's own fault line
                raise failed[0]
        books = record.books
        self.report[req_id] = (books.peak[0], books.evicted[0], books.compactions[0], books.budgets[0])

    def _decode(
        self,
        batch: StepBatch,
        ids: list[str],
        hidden: dict[int, torch.Tensor],
        slots: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        """One new token in each of ``ids``'s rows, observed and counted as one batch."""
        books, state = self.requests.batch(ids)
        rows = len(ids)
        signals = StepSignals(
            hidden={layer: h[tokens][:, None] for layer, h in hidden.items()},
            valid=torch.ones(rows, 1, dtype=torch.bool),
            positions=positions[:, None],
            prefill=False,
        )
        for name, value in self.spec.policy.observe(state, signals).items():
            self.store.write_buffer(name, slots, value[..., 0])  # type: ignore[union-attr]
        books.grow([1] * rows, 1, decode=True)
        books.seen = books.seen + 1
        books.since = [s + 1 for s in books.since]
        due = books.due(self.spec.interval)
        failed: dict[int, Exception] = {}
        if due:
            state, failed = self._compact(batch, ids, books, state, due)
        self.requests.set_state(state)
        counters = zip(books.peak, books.evicted, books.compactions, books.budgets, strict=True)
        self.report.update(
            (r, c) for i, (r, c) in enumerate(zip(ids, counters, strict=True)) if i not in failed
        )
        for i, err in failed.items():  # after set_state: a fault writes the batch back to its records
            self.fault(ids[i], f"compaction failed: {type(err).__name__}: {err}")

    def _compact(
        self, batch: StepBatch, ids: list[str], books: Any, state: Any, rows: list[int]
    ) -> tuple[Any, dict[int, Exception]]:
        """Compact rows ``rows`` of a batch (``ids`` its request ids); returns the batch's state and
        the rows that failed, with what they raised. Rows of each budget are scored in one call, so a
        policy always sees one K (as in epikv's cache). A group that raises is retried row by row and
        only the rows that raise again fail: no row's failure fails another row or another group."""
        failed: dict[int, Exception] = {}
        budgets = books.budgets
        for k in sorted({budgets[r] for r in rows}):
            group = [r for r in rows if budgets[r] == k]
            state = self._compact_group(batch, ids, books, state, group, k, failed)
        return state, failed

    def _compact_group(
        self,
        batch: StepBatch,
        ids: list[str],
        books: Any,
        state: Any,
        rows: list[int],
        budget: int,
        failed: dict[int, Exception],
    ) -> Any:
        """Choose the group's compaction in one call, or each row's alone if that call raises (a row
        that raises alone fails), then do them."""
        chosen: list[tuple[list[int], Compaction]] = []
        try:
            done, state = self._choose(batch, ids, books, state, rows, budget)
            chosen.append((rows, done))
        except Exception as err:
            for r in self._alone(ids, rows, err, failed):
                try:
                    done, state = self._choose(batch, ids, books, state, [r], budget)
                    chosen.append(([r], done))
                except Exception as again:
                    log.exception("epikv: compaction of request %s failed alone too", ids[r])
                    failed[r] = again
        for group, done in chosen:
            self._apply(ids, books, group, done, failed)
        return state

    @staticmethod
    def _alone(ids: list[str], rows: list[int], err: Exception, failed: dict[int, Exception]) -> list[int]:
        """A call for ``rows`` raised ``err``: the rows to retry one at a time (none if it was one
        row's call: that row fails)."""
        if len(rows) == 1:
            log.exception("epikv: compaction of request %s failed", ids[rows[0]])
            failed[rows[0]] = err
            return []
        log.exception("epikv: compaction of %d requests failed; retrying each alone", len(rows))
        return rows

    def _choose(
        self, batch: StepBatch, ids: list[str], books: Any, state: Any, rows: list[int], budget: int
    ) -> tuple[Compaction, Any]:
        """Score and select rows ``rows`` (one budget) in one call; nothing is written yet."""
        assert self.store is not None and batch.blocks is not None
        held = [books.held[r] for r in rows]
        width, block = max(held), self.block_size
        slot_rows = []
        for r in rows:
            blocks = torch.tensor(list(batch.blocks(ids[r])), dtype=torch.long)
            row = (blocks[:, None] * block + torch.arange(block)).reshape(-1)[:width]
            slot_rows.append(torch.cat([row, row[:1].expand(width - row.shape[0])]))
        view = PagedView(
            self.store,
            torch.stack(slot_rows),
            torch.tensor(held),
            books.prompt_len[rows],
            books.seen[rows],
            budget,
        )
        store, spec = self.store, self.spec
        return on_rows(state, rows, len(books), lambda part: choose(store, spec, part, view))

    def _apply(
        self, ids: list[str], books: Any, rows: list[int], done: Compaction, failed: dict[int, Exception]
    ) -> None:
        """Do a chosen compaction of ``rows``; if it raises, do each row's part again alone (doing a
        part twice is doing it once), and fail the rows that raise again. Then count and trace."""
        assert self.store is not None
        try:
            done.apply(self.store)
        except Exception as err:
            for i, r in enumerate(self._alone(ids, rows, err, failed)):
                try:
                    done.row(i).apply(self.store)
                except Exception as again:
                    log.exception("epikv: moving request %s's tokens failed alone too", ids[r])
                    failed[r] = again
        for i, r in enumerate(rows):
            if r in failed:
                continue
            books.compacted([r], [done.kept[i]])
            self.requests.dropped[ids[r]] = int(books.evicted[r])
            if self._trace is not None:
                try:
                    record = {"request": ids[r], "seen": int(books.seen[r]), "kept": done.positions[i]}
                    self._trace.write(json.dumps(record) + "\n")
                    self._trace.flush()
                except Exception as err:  # a full disk, say: this row's line is lost, so it fails
                    log.exception("epikv: tracing request %s failed", ids[r])
                    failed[r] = err
