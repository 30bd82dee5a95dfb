"""The one decode engine: a running batch of requests over one budgeted cache.

Every decode in epikv — ``generate``, ``eval``, the fidelity and speed benchmarks, calibration and the
server — is a client of :class:`Engine`. A request passes the gate once (:meth:`Engine.validate`:
can it ever run here, and how many slots it reserves), is *submitted* to the scheduler with that
reservation and *added* when admitted: it is prefilled alone into a row of its own and spliced into
the running batch (its cache rows, true positions, validity and the policy's per-row state), so in
float32 a request yields the tokens it yields alone (in bfloat16 up to rounding: README).
:meth:`Engine.step` admits what fits, runs one forward for every live row, picks one token per row
(or feeds the forced one) and lets finished rows go. :attr:`Engine.rows` is the one list of who
runs, each row with its reservation, so a row that leaves has freed its slots. It owns the
requests' lifetimes; the gate owns whether a request fits, the scheduler when it runs, the cache
the memory, the runner the model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from epikv.cache import BudgetedCache, SequenceStats
from epikv.engine.admission import Admission
from epikv.engine.request import Completion, Request
from epikv.engine.runner import Runner, new_generator, pick
from epikv.engine.scheduler import Scheduler, SchedulerLimits, footprint
from epikv.integration import model_info
from epikv.spec import CacheSpec


@dataclass
class _Live:
    """A request that has been prefilled (row i of the running cache is ``Engine.rows[i]``), with the
    cache slots it reserved (its row's own width in the arena; the windows' rings included)."""

    request: Request
    slots: int
    generator: torch.Generator | None
    started: float
    prefill_seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)
    first_evicted: int | None = None
    reason: str = ""


def kept_positions(cache: BudgetedCache, row: int) -> torch.Tensor:
    """True positions of one row's cached slots in every layer, (layers, H, L); -1 at holes."""
    return cache.row_positions(row).clone()


def fill_gaps(rows: int, leaving: list[int]) -> list[int]:
    """The rows that stay, in their new order: the last staying rows move into the gaps the leaving
    ones open, so only they are copied (rows are independent; their order carries no meaning)."""
    gone = set(leaving)
    keep = [r for r in range(rows) if r not in gone]
    tail = [r for r in keep if r >= len(keep)]
    out = [r if r < len(keep) and r not in gone else None for r in range(len(keep))]
    for i, slot in enumerate(out):
        if slot is None:
            out[i] = tail.pop()
    return [r for r in out if r is not None]


class Engine:
    """One spec, one model, one running batch; see the module docstring."""

    def __init__(self, model: nn.Module, spec: CacheSpec, limits: SchedulerLimits | None = None) -> None:
        self.spec = spec
        self.runner = Runner(model, spec)
        self.scheduler: Scheduler[Request] = Scheduler(limits)
        self.cache = self.runner.new_cache(max_slots=self.scheduler.limits.kv_pool)
        self.rows: list[_Live] = []  # who runs, in the cache's row order; each keeps its reservation
        info = model_info(model)
        self.context_length = info.context_length
        # window_slots: a row's sliding-window rings, in pool slots
        self.admission = Admission(
            spec, info.context_length, info.window_slots, self.scheduler.limits.kv_pool
        )
        self.tokens_out = 0  # tokens chosen so far (for metrics)
        self.evictions_done = 0  # tokens evicted from requests that have finished (for metrics)

    # -- hooks held for a run of many steps (optional: each call installs them otherwise) ---------
    def __enter__(self) -> Engine:
        self.runner.attachment.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner.attachment.__exit__(*exc)

    # -- admission -------------------------------------------------------------------------------
    def validate(self, request: Request) -> int:
        """The slots ``request`` reserves, or the :class:`~epikv.errors.AdmissionError` that says why
        it can never run here, before any compute (the gate: :class:`Admission`)."""
        return self.admission.check(request)

    def submit(self, request: Request) -> None:
        """Queue ``request``; :meth:`step` admits it when the pool and batch limits allow."""
        self.scheduler.enqueue(request, self.validate(request), self.rows)

    def add(self, request: Request) -> Completion | None:
        """Admit ``request`` now: prefill it alone, pick its first token and splice its row into the
        running batch. Returns its completion if it finished on that first token."""
        slots = self.validate(request)
        if not self.scheduler.can_admit(self.rows, slots):
            raise RuntimeError(f"admitting {slots} slots would exceed the pool or the batch limit")
        return self._start(request, slots)

    def _start(self, request: Request, slots: int) -> Completion | None:
        """Prefill ``request`` into a row of its own; it joins :attr:`rows` (taking its reservation
        with it) unless it finished on its first token, which frees the reservation at once."""
        live = _Live(request, slots, new_generator(request.sampling), time.perf_counter())
        # Prefilled straight into the row it will decode in: joining the batch copies nothing.
        arena_slots = slots - self.admission.window_slots  # the windows keep their rings apart
        cache = self.cache.row_cache(request.budget, arena_slots, request.prompt_tokens)
        if request.prefix is not None:
            request.prefix.copy_prefix(request.prefix_length, cache)
        logits = self.runner.prefill(cache, request.prompt_ids, request.on_prefill, request.on_prompt_logits)
        live.prefill_seconds = time.perf_counter() - live.started
        if request.on_compaction is not None and cache.row_compactions[0]:
            request.on_compaction(0, kept_positions(cache, 0))
        greedy = int(logits.argmax())
        if self._choose(live, logits, greedy, evicted=False):
            done = self._completion(live, cache.row_compactions[0], cache.stats()[0])
            self.evictions_done += done.evictions
            return done
        self.cache.append(cache)
        self.rows.append(live)
        return None

    # -- decoding --------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def reserved_slots(self) -> int:
        """Slots the running rows hold in the arena: rows x the widest reservation."""
        return footprint(self.rows)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return bool(self.rows or self.scheduler.waiting)

    def step(self) -> list[Completion]:
        """Admit what fits, then one forward for every live row; returns the requests that finished."""
        admitted = self.scheduler.admissible(self.rows)  # each joins self.rows before the next is asked
        done = [c for request, slots in admitted if (c := self._start(request, slots)) is not None]
        if not self.rows:
            return done
        evicted = [n > 0 for n in self.cache.row_compactions]
        watched = {
            r: self.cache.row_compactions[r]
            for r, live in enumerate(self.rows)
            if live.request.on_compaction is not None
        }
        tokens = torch.tensor([live.tokens[-1] for live in self.rows], device=self.runner.device)
        logits = self.runner.decode(self.cache, tokens)
        for row, before in watched.items():
            if self.cache.row_compactions[row] != before:
                self.rows[row].request.on_compaction(
                    len(self.rows[row].tokens), kept_positions(self.cache, row)
                )
        greedy = logits.argmax(dim=-1).tolist()
        finished = [
            row
            for row, live in enumerate(self.rows)
            if self._choose(live, logits[row], greedy[row], evicted[row])
        ]
        if finished:
            done.extend(self._release(finished))
        return done

    def _choose(self, live: _Live, logits: torch.Tensor, greedy: int, evicted: bool) -> bool:
        """Pick (or force) a row's next token from its logits (V,); True when the request is done."""
        request, index = live.request, len(live.tokens)
        if evicted and live.first_evicted is None:
            live.first_evicted = index
        if request.on_logits is not None:
            request.on_logits(index, logits, evicted)
        if request.forced is not None:
            token = int(request.forced[index])
        elif request.sampling.greedy:
            token = greedy
        else:
            token = pick(logits, request.sampling, live.generator)
        live.tokens.append(token)
        self.tokens_out += 1
        if request.on_token is not None and request.on_token(token):
            live.reason = "stop"
        elif token in request.stop_ids:
            live.reason = "eos"
        elif len(live.tokens) >= request.max_new_tokens:
            live.reason = "length"
        return bool(live.reason)

    # -- leaving ---------------------------------------------------------------------------------
    def finish(self, request_id: int, reason: str = "cancelled") -> Completion | None:
        """Stop a request now (a client that left): drop its row, or take it out of the queue.
        Returns its completion, or None if it is not known (already finished)."""
        for row, live in enumerate(self.rows):
            if live.request.id == request_id:
                live.reason = reason
                return self._release([row])[0]
        for request, _ in list(self.scheduler.waiting):
            if request.id == request_id:
                self.scheduler.remove(request)
                return None
        return None

    def _release(self, rows: list[int]) -> list[Completion]:
        """Let ``rows`` go: their completions, and the rest keep running (their reservations with them)."""
        stats, compactions = self.cache.stats(), self.cache.row_compactions
        out = [self._completion(self.rows[r], compactions[r], stats[r]) for r in rows]
        self.evictions_done += sum(c.evictions for c in out)
        keep = fill_gaps(len(self.rows), rows)
        self.cache.keep_rows(keep)
        self.rows = [self.rows[r] for r in keep]
        return out

    def clear(self) -> None:
        """Drop every running row and waiting request at once, without completions (after a step
        that failed: the rows' state cannot be trusted)."""
        self.cache.keep_rows([])
        self.rows = []
        self.scheduler.waiting.clear()

    def _completion(self, live: _Live, compactions: int, stats: SequenceStats) -> Completion:
        return Completion(
            request_id=live.request.id,
            token_ids=live.tokens,
            finish_reason=live.reason,
            prompt_tokens=live.request.prompt_tokens,
            peak_cache_tokens=stats.peak_cache_tokens,
            final_cache_tokens=stats.final_cache_tokens,
            evictions=stats.evictions,
            compactions=compactions,
            first_evicted_index=live.first_evicted,
            prefill_seconds=live.prefill_seconds,
            seconds=time.perf_counter() - live.started,
            mean_cache_tokens=stats.mean_cache_tokens,
            budget=stats.budget,
        )

    # -- a whole batch ----------------------------------------------------------------------------
    def run(self, requests: Iterable[Request]) -> list[Completion]:
        """Submit every request and step until all are done; completions in the requests' order."""
        order = []
        for request in requests:
            self.submit(request)
            order.append(request.id)
        done: dict[int, Completion] = {}
        with self:
            while self.has_work():
                for completion in self.step():
                    done[completion.request_id] = completion
        return [done[i] for i in order]

    def live_stats(self) -> dict[str, int]:
        """Counters for metrics: running rows, waiting requests, cached tokens, reserved slots."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "cached_tokens": sum(self.cache.held),
            "reserved_slots": self.reserved_slots,
            "evictions": self.evictions_done + sum(self.cache.evicted),
        }
