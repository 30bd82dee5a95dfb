"""What the plugin does around each of vLLM's forward passes, inside the worker.

Before the forward (:meth:`EpiKVWorkerState.physical`): positions stay logical (RoPE sees true
positions), while each row's attention length and the slots its new tokens are written to become
physical (logical minus what the row has evicted); and every row's physical length is checked
against its blocks, so a broken cap is a loud error, never a write into someone else's block.

After the forward (:meth:`EpiKVWorkerState.after_forward`): the new tokens' true positions are stored
beside their slots, the policy observes the band layers' hidden states (vLLM's own aux hidden
states), the books count the step, and each row that is due (held > K and tau steps since its last
compaction: :meth:`RowBooks.due`) is compacted in place (:func:`epikv.vllm.compaction.compact`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from epikv.policies.base import ModelInfo, StepSignals
from epikv.policies.rows import on_rows
from epikv.spec import CacheSpec
from epikv.vllm.compaction import PagedView, SlotStore, compact
from epikv.vllm.config import EpiKVSettings, cap_tokens, check_prompt_fits
from epikv.vllm.requests import Requests


class EpiKVWorkerState:
    """The plugin's state in one worker: the spec, the requests' books and state, the slot store."""

    def __init__(self, settings: EpiKVSettings, spec: CacheSpec, model: ModelInfo) -> None:
        self.settings, self.spec, self.model = settings, spec, model
        self.cap = cap_tokens(spec)
        hidden = spec.policy.needs().hidden_layers
        # aux hidden state i+1 is decoder layer i's output (hidden + residual), i.e. HF's layer output
        self.aux_layers = tuple(sorted({layer + 1 for layer in hidden}))
        self.requests = Requests(spec, model)
        self.store: SlotStore | None = None
        self.block_size = 0
        # req_id -> (peak physical tokens, tokens evicted, compactions) after this step's forward
        self.report: dict[str, tuple[int, int, int]] = {}
        self._trace = open(settings.trace, "a") if settings.trace else None

    @property
    def evicts(self) -> bool:
        return self.spec.budget is not None

    # -- request lifecycle ------------------------------------------------------------------------
    def before_update(self, out: Any) -> None:
        preempted = set(out.preempted_req_ids or ()) | set(out.scheduled_cached_reqs.resumed_req_ids)
        if self.evicts and preempted:
            raise RuntimeError(
                f"epikv: requests {sorted(preempted)} were preempted or resumed; an evicting request "
                "cannot be re-prefilled from its compacted cache"
            )
        for req_id in out.finished_req_ids:
            self.requests.remove(req_id)

    def after_update(self, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            prompt = len(new.prompt_token_ids or ())
            check_prompt_fits(self.spec, prompt)
            self.requests.add(new.req_id, prompt)

    # -- before the forward -----------------------------------------------------------------------
    def physical(self, runner: Any, scheduled: np.ndarray) -> None:
        """Physical attention lengths and slots for this step's rows (positions stay logical)."""
        batch = runner.input_batch
        n = batch.num_reqs
        ids = batch.req_ids[:n]
        dropped = np.array([self.requests.dropped[r] for r in ids], dtype=np.int64)
        held_after = batch.num_computed_tokens_cpu[:n] - dropped + scheduled[:n]
        room = batch.block_table[0].num_blocks_per_row[:n].astype(np.int64) * self.block_size
        if (held_after > room).any():
            row = int(np.argmax(held_after > room))
            raise RuntimeError(
                f"epikv: request {ids[row]} would hold {held_after[row]} tokens in {room[row]} slots; "
                "its cap of K + tau was broken"
            )
        if not dropped.any():
            return
        total = int(scheduled[:n].sum())
        per_row = torch.from_numpy(dropped)
        runner.seq_lens[:n] -= per_row.to(runner.seq_lens.dtype)
        per_token = torch.from_numpy(dropped[runner.req_indices.np[:total]])
        physical = runner.positions[:total] - per_token
        batch.block_table.compute_slot_mapping(n, runner.query_start_loc.gpu[: n + 1], physical)

    # -- after the forward ------------------------------------------------------------------------
    def after_forward(self, runner: Any, aux: list[torch.Tensor] | None) -> None:
        """Store the new tokens' positions, let the policy observe, count, and compact due rows."""
        assert self.store is not None
        batch = runner.input_batch
        n = batch.num_reqs
        ids = list(batch.req_ids[:n])
        starts = runner.query_start_loc.np[: n + 1].astype(np.int64)
        total = int(starts[n])
        slots = batch.block_table[0].slot_mapping.gpu[:total].long()
        positions = runner.positions[:total]
        self.store.write(slots, positions)
        hidden = dict(zip([a - 1 for a in self.aux_layers], aux or [], strict=True))
        computed, prompts = batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n]
        decode = [i for i in range(n) if computed[i] >= prompts[i]]
        self.report = {}
        for i in range(n):
            if computed[i] < prompts[i]:
                lo, hi = int(starts[i]), int(starts[i + 1])
                done = computed[i] + hi - lo >= prompts[i]
                self._prefill(runner, ids[i], hidden, slots[lo:hi], positions[lo:hi], hi - 1, done)
        if decode:
            last = torch.from_numpy(starts[1:][decode] - 1)
            self._decode(runner, [ids[i] for i in decode], hidden, slots[last], positions[last], last)

    def _prefill(
        self,
        runner: Any,
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
            record.state = self._compact(runner, [req_id], record.books, record.state, [0])
        books = record.books
        self.report[req_id] = (books.peak[0], books.evicted[0], books.compactions[0])

    def _decode(
        self,
        runner: Any,
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
        if due:
            state = self._compact(runner, ids, books, state, due)
        self.requests.set_state(state)
        self.report.update(
            zip(ids, zip(books.peak, books.evicted, books.compactions, strict=True), strict=True)
        )

    def _compact(self, runner: Any, ids: list[str], books: Any, state: Any, rows: list[int]) -> Any:
        """Compact rows ``rows`` of a batch (``ids`` its request ids); returns the batch's state."""
        assert self.store is not None and self.spec.budget is not None
        held = [books.held[r] for r in rows]
        width, block = max(held), self.block_size
        slot_rows = []
        for r in rows:
            blocks = torch.tensor(runner.requests[ids[r]].block_ids[0], dtype=torch.long)
            row = (blocks[:, None] * block + torch.arange(block)).reshape(-1)[:width]
            slot_rows.append(torch.cat([row, row[:1].expand(width - row.shape[0])]))
        view = PagedView(
            self.store,
            torch.stack(slot_rows),
            torch.tensor(held),
            books.prompt_len[rows],
            books.seen[rows],
            self.spec.budget,
        )
        result, state = on_rows(
            state, rows, len(books), lambda part: compact(self.store, self.spec, part, view)
        )
        books.compacted(rows, result.kept)
        for r, kept in zip(rows, result.positions, strict=True):
            self.requests.dropped[ids[r]] = int(books.evicted[r])
            if self._trace is not None:
                record = {"request": ids[r], "seen": int(books.seen[r]), "kept": kept}
                self._trace.write(json.dumps(record) + "\n")
        if self._trace is not None:
            self._trace.flush()
        return state
