"""Scheduler side: each evicting request reserves what it can ever hold, up front, and fails alone.

The worker compacts a request back to its K every tau steps once it holds more, so its physical
length never passes its cap (:meth:`epikv.spec.CacheSpec.cap_tokens`: max(P, K) + tau at most, P its
prompt). Each request is planned once, by the rule every host shares
(:func:`epikv.vllm.config.plan_request`): its K (the server's, or its own ``epikv_budget``), its cap,
and its reservation, min(cap, prompt + ``max_tokens``), clamped as vLLM clamps its own (never past
``max_model_len``, nor the runner's block-table row). The capped manager (vLLM's official
KV-cache-spec registry maps :class:`EpiKVAttentionSpec` to it) gives a request all its reserved
blocks at its first allocation and never more, so admission is vLLM's own: a waiting request runs
when the pool holds its reservation, and a running evicting request never asks for a block, so it is
never preempted for one. The scheduler keeps counting logical tokens.

A request that cannot run (a bad budget, a prompt its budget cannot protect, a reservation larger
than the pool, a resumable session), one that would be preempted (``reset_prefix_cache`` with
running requests, ``pause_generation(mode="keep")``: a compacted cache cannot be re-prefilled), and
one whose step failed in the worker, finishes alone with vLLM's ``error`` finish and one log line
naming the cause (also on its output: ``kv_transfer_params["epikv"]["error"]``); the engine serves on.

Prefix caching, for policies that protect the prompt: only a request's full prompt blocks are ever
cached (compaction never moves or overwrites a prompt token), never a block it generates into.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.request import RequestStatus

from epikv.errors import AdmissionError
from epikv.spec import CacheSpec
from epikv.vllm.config import (
    KEY,
    EpiKVSettings,
    RequestPlan,
    check_pool,
    longest_request,
    model_info,
    plan_request,
)
from epikv.vllm.counters import Counters

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpiKVAttentionSpec(FullAttentionSpec):
    """Full attention under an evicting policy: ``cap_tokens`` is K + tau, what one request with a
    prompt of at most K holds (0 = the policy never evicts)."""

    cap_tokens: int = 0

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        merged = super().merge(specs)
        caps = {s.cap_tokens for s in specs}
        if len(caps) != 1:
            raise ValueError(f"epikv: layers of one KV cache group disagree on the cap: {sorted(caps)}")
        return dataclasses.replace(merged, cap_tokens=caps.pop())

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """What one request can hold at vLLM's ``max_model_len`` (which vLLM's start-up check and its
        auto-fit vary): the plan of the longest prompt vLLM admits (:func:`longest_request`). A prompt
        is held whole until its first compaction, so that is max_model_len (or a token less), as in
        plain vLLM: a pool that cannot hold it refuses to start, or lowers max_model_len."""
        if not self.cap_tokens:
            return super().max_memory_usage_bytes(vllm_config)
        tokens = longest_request(run_spec(vllm_config), vllm_config.model_config.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


_SPECS: dict[tuple[str, str], CacheSpec] = {}


def run_spec(vllm_config: Any) -> CacheSpec:
    """The engine's run spec, built once per settings and model in this process (vLLM's start-up check
    asks each layer's spec, at each max_model_len its search tries)."""
    settings = EpiKVSettings.from_config(vllm_config.additional_config)
    assert settings is not None, "an EpiKVAttentionSpec belongs to an engine with the epikv key"
    model = model_info(vllm_config)
    key = (repr(settings), repr(model))
    if key not in _SPECS:
        _SPECS[key] = settings.spec(model)
    return _SPECS[key]


class EpiKVAttentionManager(FullAttentionManager):
    """Full-attention blocks for planned requests: all of a request's reservation at its first
    allocation, never more; only full prompt blocks are cached. Requests without a plan (or whose
    policy never evicts) are vLLM's as usual."""

    plans: dict[str, RequestPlan] | None = None  # the scheduler's, shared
    # a hybrid's sliding-window headroom a request's admission must leave free (see EpiKVScheduler)
    headroom: Callable[[str], int] | None = None

    def _reserved(self, request_id: str, num_tokens: int) -> int:
        plan = self.plans.get(request_id) if self.plans is not None else None
        return num_tokens if plan is None or plan.reserve is None else plan.reserve

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        blocks = super().get_num_blocks_to_allocate(
            request_id, self._reserved(request_id, num_tokens), *args, **kwargs
        )
        first = not self.req_to_blocks.get(request_id)
        plan = self.plans.get(request_id) if self.plans is not None else None
        if first and plan is not None and plan.cap is not None and self.headroom is not None:
            blocks += self.headroom(request_id)  # counted, never allocated: admission leaves it free
        return blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> Any:
        return super().allocate_new_blocks(
            request_id, self._reserved(request_id, num_tokens), self._reserved(request_id, num_tokens)
        )

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        plan = self.plans.get(request.request_id) if self.plans is not None else None
        if plan is not None and plan.cap is not None:  # blocks past the prompt can be compacted
            num_tokens = min(num_tokens, request.num_prompt_tokens // self.block_size * self.block_size)
        super().cache_blocks(request, num_tokens, *args, **kwargs)


def register_spec() -> None:
    """Map :class:`EpiKVAttentionSpec` to its manager (idempotent; grouped with full attention)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        EpiKVAttentionSpec, EpiKVAttentionManager, uniform_type_base_spec=FullAttentionSpec
    )


def capped_spec(spec: FullAttentionSpec, cap: int | None) -> EpiKVAttentionSpec:
    """``spec`` with the cap (None: no cap, for ``full``)."""
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return EpiKVAttentionSpec(**values, cap_tokens=cap or 0)


class EpiKVScheduler(Scheduler):
    """vLLM's scheduler with each request planned at admission (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.epikv_plans: dict[str, RequestPlan] = {}
        self.epikv_counters: dict[str, Counters] = {}  # the worker's latest
        self._epikv_failed: list[tuple[int, EngineCoreOutput]] = []
        self._epikv_final: dict[str, Counters] | None = None
        settings = EpiKVSettings.from_config(vllm_config.additional_config or {})
        self.epikv_spec = settings.spec(model_info(vllm_config)) if settings is not None else None
        self.epikv_usable_blocks = kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block
        self.epikv_block = 0
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self.epikv_windows = [m for m in managers if isinstance(m, SlidingWindowManager)]
        self.epikv_chunk = vllm_config.scheduler_config.max_num_batched_tokens
        self._epikv_alone = False  # True while epikv_alone_blocks counts a newcomer on an empty pool
        for manager in managers:
            if isinstance(manager, EpiKVAttentionManager):
                manager.plans = self.epikv_plans
                manager.headroom = self.epikv_headroom if self.epikv_windows else None
                self.epikv_block = manager.block_size
        if self.epikv_spec is not None and self.epikv_spec.evicts:
            cap = self.epikv_spec.cap_tokens(0)
            log.info(
                "%s: each request reserves min(its cap, prompt + max_tokens) tokens; a prompt of at most "
                "K holds at most K + tau = %s",
                KEY,
                cap,
            )

    # -- admission --------------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        spec = self.epikv_spec
        if known or spec is None or not spec.evicts:
            return
        try:
            if request.resumable:
                raise AdmissionError("resumable (streaming-input) sessions are not supported")
            if request.prompt_token_ids is None:
                raise AdmissionError("prompt embeddings are not supported")
            params = request.sampling_params
            prompt, extra = request.num_prompt_tokens, params.extra_args if params else None
            plan = plan_request(spec, prompt, request.max_tokens, extra, self.max_model_len)
            self.epikv_plans[request.request_id] = plan  # the global group's count reads it
            windows = 0
            if self.epikv_windows:  # what allocation will count, on an empty pool, less the reservation
                windows = self.epikv_alone_blocks(request) - cdiv(plan.reserve or 0, self.epikv_block)
            check_pool(spec, plan, prompt, self.epikv_block, self.epikv_usable_blocks, windows)
        except AdmissionError as err:
            self.epikv_plans.pop(request.request_id, None)
            self.epikv_fail(request, str(err), refused=err.field)

    # -- a hybrid's sliding-window groups ---------------------------------------------------------
    def epikv_window_blocks(self, manager: Any, tokens: int) -> int:
        """The most blocks ``manager`` (a sliding-window group) holds for a request while it computes
        ``tokens`` new ones: those of the window behind them and of the tokens, wherever the window
        starts in a block (vLLM frees the blocks behind the window before it allocates)."""
        return 1 + cdiv(manager.sliding_window + tokens - 2, manager.block_size)

    def epikv_next_tokens(self, left: int) -> int:
        """The tokens a request with ``left`` prompt tokens still to compute computes at its next step
        at most (a prompt chunk, or one)."""
        return min(left, self.epikv_chunk) if left > 0 else 1

    def epikv_headroom(self, request_id: str) -> int:
        """Blocks the global group's count adds when ``request_id`` is first allocated: its
        :meth:`epikv_window_need` among the running requests (counted, never allocated; alone while
        :meth:`epikv_alone_blocks` counts)."""
        running = () if self._epikv_alone else self.running
        return self.epikv_window_need(self.requests[request_id], running)

    def epikv_alone_blocks(self, request: Any) -> int:
        """The blocks vLLM's allocation counts for ``request`` on an empty pool (no prefix hit), every
        group together, through vLLM's own count (``KVCacheCoordinator.get_num_blocks_to_allocate``,
        in which the global group's count is the reservation plus :meth:`epikv_headroom`): the larger
        of its full-sequence check (the whole prompt, with vLLM's admission cap on sliding groups) and
        its first chunk's. So arrival and allocation are one rule: a request that passes at arrival
        is placed on an empty pool, and never waits forever at the head of vLLM's queue."""
        coordinator = self.kv_cache_manager.coordinator
        none: tuple[tuple[()], ...] = tuple(() for _ in coordinator.single_type_managers)
        prompt = request.num_prompt_tokens
        self._epikv_alone = True
        try:
            return max(
                coordinator.get_num_blocks_to_allocate(
                    request.request_id, n, none, 0, 0, 0, n, apply_admission_cap=cap, prefill_end=prompt
                )
                for n, cap in ((prompt, True), (min(prompt, self.epikv_chunk), False))
            )
        finally:
            self._epikv_alone = False

    def epikv_window_need(self, request: Any, running: Any) -> int:
        """epikv's part of the admission rule for a hybrid's sliding-window groups, beyond the blocks
        vLLM counts itself (the newcomer's first chunk: ``cdiv(first, block)`` with no prefix hit),
        at arrival (``running`` empty, through :meth:`epikv_alone_blocks`: can it ever run?) and at
        allocation (among ``self.running``). Global blocks are reserved whole at
        admission; sliding ones are vLLM's, recycled as the window moves, so a request's step can need
        up to :meth:`epikv_window_blocks` of them. Left free: the newcomer's shortfall at its second
        step (that bound for its next tokens, less its first chunk's blocks) and each running planned
        request's shortfall against its next step. So the pool's free blocks stay at least the running
        requests' total shortfall (each allocation lowers both by one, each free raises both): no
        running evicting request is ever preempted for a sliding block (which would fail it: a
        compacted cache cannot be re-prefilled); and a request admitted at arrival fits an empty
        pool, so it never waits forever at the head of vLLM's queue."""
        first = min(request.num_prompt_tokens, self.epikv_chunk)
        need = self.epikv_next_tokens(request.num_prompt_tokens - first)
        total = 0
        for manager in self.epikv_windows:
            first_blocks = cdiv(first, manager.block_size)
            total += max(0, self.epikv_window_blocks(manager, need) - first_blocks)
            for other in running:
                if other.request_id == request.request_id or other.request_id not in self.epikv_plans:
                    continue
                held = sum(not b.is_null for b in manager.req_to_blocks.get(other.request_id, ()))
                left = other.num_prompt_tokens - other.num_computed_tokens
                want = self.epikv_window_blocks(manager, self.epikv_next_tokens(left))
                total += max(0, want - held)
        return total

    def epikv_fail(self, request: Any, why: str, refused: str | None = None) -> None:
        """Finish ``request`` alone with vLLM's ``error`` finish; the output goes out with this step's.
        ``refused``: the request field to blame when the request can never run (a deterministic
        refusal, a 400 under ``vllm serve``; a fault that may pass is a 500)."""
        message = f"epikv: request {request.request_id}: {why}"
        log.warning("%s", message)
        counters = self.epikv_counters.get(request.request_id)
        stats: dict[str, Any] = counters.as_params() if counters else {}
        if refused is not None:
            stats["refused"] = refused
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)  # from whichever queue
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            kv_transfer_params={KEY: {**stats, "error": message}},
        )
        self._epikv_failed.append((request.client_index, output))

    def _preempt_request(self, request: Any, timestamp: float, drop_stale_output: bool = False) -> None:
        plan = self.epikv_plans.get(request.request_id)
        if plan is None or plan.cap is None:
            super()._preempt_request(request, timestamp, drop_stale_output)
            return
        self.epikv_fail(  # the caller popped it from the running queue
            request,
            "preempted (a prefix-cache reset or a pause with running requests); an evicting request "
            "cannot be re-prefilled from its compacted cache",
        )

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        """Every finish passes here (EOS, length, stop strings, aborts, errors): nothing of the
        request outlives it; its last counters go out with this step's outputs."""
        self.epikv_plans.pop(request.request_id, None)
        counters = self.epikv_counters.pop(request.request_id, None)
        if counters is not None and self._epikv_final is not None:
            self._epikv_final[request.request_id] = counters
        return super()._free_request(request, delay_free_blocks)

    # -- after each step ----------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update, plus: the worker's faults fail their requests alone; every output of a
        planned request carries its counters as ``kv_transfer_params["epikv"]`` (so a request the
        front end finishes, on a stop string, has them too); failed requests' outputs are added."""
        counters = self.epikv_counters
        for req_id, values in (getattr(model_runner_output, "epikv", None) or {}).items():
            if req_id in self.requests:
                counters[req_id] = values
        for req_id, why in (getattr(model_runner_output, "epikv_faults", None) or {}).items():
            if (request := self.requests.get(req_id)) is not None:
                self.epikv_fail(request, why)
        self._epikv_final = {}
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            final = self._epikv_final
        finally:
            self._epikv_final = None
        for batch in outputs.values():
            for out in batch.outputs:
                values = counters.get(out.request_id) or final.get(out.request_id)
                if values is not None:
                    out.kv_transfer_params = {**(out.kv_transfer_params or {}), KEY: values.as_params()}
        for client, output in self._epikv_failed:
            if client not in outputs:
                outputs[client] = EngineCoreOutputs(outputs=[])
            outputs[client].outputs.append(output)
        self._epikv_failed.clear()
        return outputs
