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
last compaction: :meth:`RowBooks.due`) is compacted in place (:mod:`epikv.vllm.step_compact`).
Whatever goes wrong for a request there faults that request, with one line naming the cause; the
step goes on for every other row. A compaction that raises is retried per row and fails only the
rows that raise alone; an exception while observing a decode step (one call for the batch's shared
state) fails the batch's rows.

Tensor parallelism (:meth:`EpiKVWorkerState.agree`): every rank runs this step on the same rows.
Before compacting, the ranks agree on which requests faulted this step (on any rank), so every rank
compacts the same rows (an exception before that agreement, outside any one request's part, fails
every row of the step on its rank, so the agreement fails them on every rank); each scoring call
(which gathers heads across ranks) has one verdict on every rank
(:meth:`epikv.vllm.compaction.HeadShards.together`); after a step that compacted, they agree
again (a move or a trace line can fail on one rank). So no rank enters a collective another skips,
and a fault on any rank reaches the first rank's output, which is what the scheduler reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from epikv.policies.base import ModelInfo, StepSignals
from epikv.policies.rows import snapshot_rows
from epikv.spec import CacheSpec
from epikv.vllm.compaction import PEER_FAILED, SlotStore
from epikv.vllm.config import EpiKVSettings, plan_request, request_rank_every
from epikv.vllm.counters import Counters
from epikv.vllm.requests import Requests
from epikv.vllm.step_compact import RowCompactions

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
        self,
        settings: EpiKVSettings,
        spec: CacheSpec,
        model: ModelInfo,
        trace: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.settings, self.spec, self.model = settings, spec, model
        self.max_model_len = max_model_len  # vLLM's context: plans clamp to it as the scheduler's do
        self.cap = spec.cap_tokens(0)  # K + tau: what a request with a prompt of at most K holds
        hidden = spec.policy.needs().hidden_layers
        # aux hidden state i+1 is decoder layer i's output (hidden + residual), i.e. HF's layer output
        self.aux_layers = tuple(sorted({layer + 1 for layer in hidden}))
        self.requests = Requests(spec, model)
        self.store: SlotStore | None = None
        self.block_size = 0
        # req_id -> (peak physical tokens, tokens evicted, compactions, budget) after this step
        self.report: dict[str, Counters] = {}
        self.faults: dict[str, str] = {}  # req_id -> why, this step (the scheduler fails them)
        # one trace per engine: under tensor parallelism the first rank writes it (all keep the same)
        trace_file = open(settings.trace, "a") if settings.trace and trace else None
        self.compactions = RowCompactions(spec, self.requests, trace_file)

    @property
    def evicts(self) -> bool:
        return self.spec.budget is not None

    def fault(self, req_id: str, why: str) -> None:
        """This request cannot go on: forget it here; the scheduler finishes it with an error."""
        log.warning("epikv: request %s: %s", req_id, why)
        self.faults[req_id] = why
        self.report.pop(req_id, None)  # the scheduler keeps its counters of the step before
        self.requests.remove(req_id)

    def take(self) -> tuple[dict[str, Counters], dict[str, str]]:
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
                plan = plan_request(self.spec, req.prompt, req.max_tokens, req.extra_args, self.max_model_len)
            except ValueError as err:
                self.fault(req.req_id, str(err))
                continue
            rho = request_rank_every(self.spec, req.extra_args)  # checked by the plan: never raises
            self.requests.add(req.req_id, req.prompt, plan, req.cached, rho)

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
        """Store the new tokens' positions, let the policy observe, count, agree on faults (tensor
        parallelism), compact due rows, agree again if anything was compacted, and report."""
        n = len(batch.ids)
        if not self.evicts:  # ``full``: nothing to observe; the counters are the lengths
            held = (batch.computed + batch.scheduled).tolist()
            self.report.update((r, Counters(h, 0, 0, None)) for r, h in zip(batch.ids, held, strict=True))
            return
        assert self.store is not None and batch.slots is not None
        records = self.requests.records
        try:
            prefilled, ids = self._observe_step(batch, aux)
        except Exception as err:  # before the ranks agree: it fails the step's rows on every rank
            log.exception("epikv: a step of %d requests failed before compaction", n)
            for req_id in [r for r in batch.ids if r in records]:
                self._fault_step(req_id, f"step failed: {type(err).__name__}: {err}")
            prefilled, ids = [], []
        self.agree(batch.ids)  # from here on every rank holds the same rows with the same books
        compacted = False
        for req_id in prefilled:
            if req_id in records:
                compacted = self._compact_prefilled(batch, req_id) or compacted
        ids = [r for r in ids if r in records]
        if ids:
            compacted = self._compact_decoding(batch, ids) or compacted
        if compacted:  # a move or a trace line fails on one rank only
            self.agree(batch.ids)

    def _observe_step(self, batch: StepBatch, aux: list[torch.Tensor] | None) -> tuple[list[str], list[str]]:
        """Store the new tokens' positions and let the policy observe them: each prefill chunk alone
        (a raise fails its request), the decode rows together (:meth:`_observe_rows`). Returns the
        requests whose prompt is all in and the decoding ones. What raises here (the store's write,
        the decode batch's books) reaches :meth:`after_forward`, which fails the step's rows."""
        assert self.store is not None and batch.slots is not None
        n, starts = len(batch.ids), batch.starts
        total = int(starts[n])
        slots, positions = batch.slots[:total], batch.positions[:total]
        live = slots >= 0
        self.store.write(slots[live], positions[live])
        hidden = dict(zip([a - 1 for a in self.aux_layers], aux or [], strict=True))
        records = self.requests.records
        decode, prefilled = [], []
        for i, req_id in enumerate(batch.ids):
            if req_id not in records:
                continue
            if batch.computed[i] >= batch.prompts[i]:
                decode.append(i)
                continue
            lo, hi = int(starts[i]), int(starts[i + 1])
            try:
                self._prefill(req_id, hidden, slots[lo:hi], positions[lo:hi], hi - 1)
                if batch.computed[i] + hi - lo >= batch.prompts[i]:
                    prefilled.append(req_id)
            except Exception as err:  # this request's fault, not the engine's
                log.exception("epikv: prefill of request %s failed", req_id)
                self.fault(req_id, f"prefill failed: {type(err).__name__}: {err}")
        ids = [batch.ids[i] for i in decode]
        if ids:
            last = torch.from_numpy(starts[1:][decode] - 1)
            self._observe_rows(ids, hidden, slots[last], positions[last], last)
        return prefilled, ids

    def _fault_step(self, req_id: str, why: str) -> None:
        """Fault a request of a step that failed before the ranks agreed; if even its books cannot be
        written back (the decode batch broke), forget them as they are."""
        try:
            self.fault(req_id, why)
        except Exception:
            log.exception("epikv: the books of request %s could not be written back", req_id)
            self.faults[req_id] = why
            self.report.pop(req_id, None)
            self.requests.records.pop(req_id, None)
            self.requests.dropped.pop(req_id, None)

    def agree(self, ids: Sequence[str]) -> None:
        """Under tensor parallelism: a request of ``ids`` faulted on any rank this step is faulted on
        every rank, with the first rank's own line for it (so the scheduler, which reads the first
        rank's output, fails it), or the line of the first rank that saw it fail. One collective of
        len(ids) ints; a second (the lines) only in a step where some rank faulted a request."""
        shards = None if self.store is None else self.store.shards
        if shards is None or not ids:
            return
        mine = torch.tensor([int(r in self.faults) for r in ids], dtype=torch.int32)
        anywhere = shards.union(mine)
        if not bool(anywhere.any()):
            return
        failed = [r for r, flag in zip(ids, anywhere.tolist(), strict=True) if flag]
        lines = shards.objects({r: self.faults[r] for r in failed if r in self.faults})
        for req_id in failed:
            own = self.faults.get(req_id)
            seen = [ln[req_id] for ln in lines if req_id in ln and PEER_FAILED not in ln[req_id]]
            if own is None or (PEER_FAILED in own and seen):
                self.fault(req_id, seen[0] if seen else "failed on another tensor-parallel rank")

    def _prefill(
        self,
        req_id: str,
        hidden: dict[int, torch.Tensor],
        slots: torch.Tensor,
        positions: torch.Tensor,
        last: int,
    ) -> None:
        """A prompt chunk of one request: the policy sees its last state (epikv's prefill signal)."""
        record = self.requests.records[req_id]
        q = slots.shape[0]
        signals = StepSignals(  # a copy of the last row: a view would hold the whole batch's states
            hidden={layer: h[None, last : last + 1].clone() for layer, h in hidden.items()},
            valid=torch.ones(1, q, dtype=torch.bool),
            positions=positions[None],
            prefill=True,
        )
        for name, value in self.spec.policy.observe(record.state, signals).items():
            self.store.write_buffer(name, slots, value[:, 0].transpose(1, 2))  # type: ignore[union-attr]
        record.books.grow([q], q, decode=False)
        record.books.seen = record.books.seen + q
        self._report_one(req_id, record.books)

    def _report_one(self, req_id: str, books: Any) -> None:
        """A one-row request's counters after this step."""
        self.report[req_id] = Counters(
            books.peak[0], books.evicted[0], books.compactions[0], books.budgets[0]
        )

    def _compact(
        self, batch: StepBatch, ids: list[str], books: Any, state: Any, rows: list[int]
    ) -> tuple[Any, dict[int, Exception]]:
        assert self.store is not None
        return self.compactions.compact(self.store, self.block_size, batch, ids, books, state, rows)

    def _compact_prefilled(self, batch: StepBatch, req_id: str) -> bool:
        """A request whose prompt is all in: compacted if it is due (a fault is its prefill's);
        whether it was due."""
        record = self.requests.records[req_id]
        books = record.books
        if not books.due(self.spec.interval):
            return False
        record.state, failed = self._compact(batch, [req_id], books, record.state, [0])
        if failed:
            err = failed[0]
            self.fault(req_id, f"prefill failed: {type(err).__name__}: {err}")
            return True
        self._report_one(req_id, books)
        return True

    def _observe_rows(
        self,
        ids: list[str],
        hidden: dict[int, torch.Tensor],
        slots: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        """Observe the decoding rows ``ids`` in one call, or each alone if that call raises (a row
        that raises alone fails). The rows' state is restored after a call that raised (it may have
        replaced some fields first); the buffers it wrote are written again by the retries."""
        saved = snapshot_rows(self.requests.batch(ids)[1])
        try:
            self._observe(ids, hidden, slots, positions, tokens)
            return
        except Exception as err:
            self.requests.set_state(saved)
            if len(ids) == 1:
                log.exception("epikv: the decode step of request %s failed", ids[0])
                self.fault(ids[0], f"decode step failed: {type(err).__name__}: {err}")
                return
            log.exception("epikv: a decode step of %d requests failed; observing each alone", len(ids))
        for j, req_id in enumerate(ids):
            one = slice(j, j + 1)
            try:
                self._observe([req_id], hidden, slots[one], positions[one], tokens[one])
            except Exception as err:
                log.exception("epikv: the decode step of request %s failed alone too", req_id)
                self.fault(req_id, f"decode step failed: {type(err).__name__}: {err}")

    def _observe(
        self,
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
        self.requests.set_state(state)

    def _compact_decoding(self, batch: StepBatch, ids: list[str]) -> bool:
        """Compact the due rows of the decoding requests ``ids`` (observed this step) and report
        them all; whether any row was due."""
        books, state = self.requests.batch(ids)
        due = books.due(self.spec.interval)
        failed: dict[int, Exception] = {}
        if due:
            state, failed = self._compact(batch, ids, books, state, due)
            self.requests.set_state(state)
        counters = map(Counters, books.peak, books.evicted, books.compactions, books.budgets)
        self.report.update(
            (r, c) for i, (r, c) in enumerate(zip(ids, counters, strict=True)) if i not in failed
        )
        for i, err in failed.items():  # after set_state: a fault writes the batch back to its records
            self.fault(ids[i], f"compaction failed: {type(err).__name__}: {err}")
        return bool(due)
