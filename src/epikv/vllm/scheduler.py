"""Scheduler side: each evicting request's blocks are capped at ceil((K + tau) / B), never freed early.

The worker compacts a request back to K tokens every tau steps once it holds more than K, so its
physical length never passes K + tau (:func:`epikv.vllm.config.cap_tokens`). The scheduler keeps
counting logical tokens; only the number of blocks a request gets is capped, through vLLM's official
KV-cache-spec registry (a spec that carries the cap, and the manager it maps to). The scheduler
subclass admits at most ``usable blocks // cap blocks`` running requests, so the pool cannot run dry
and no evicting request is ever preempted; if one were, it fails loudly rather than re-prefilling a
compacted request whose blocks no longer hold its sequence.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpiKVAttentionSpec(FullAttentionSpec):
    """Full attention whose requests hold at most ``cap_tokens`` physical tokens (0 = no cap)."""

    cap_tokens: int = 0

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        merged = super().merge(specs)
        caps = {s.cap_tokens for s in specs}
        if len(caps) != 1:
            raise ValueError(f"epikv: layers of one KV cache group disagree on the cap: {sorted(caps)}")
        return dataclasses.replace(merged, cap_tokens=caps.pop())

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """What one request can hold: its cap, not max_model_len (so the start-up check admits a
        max_model_len far beyond the pool)."""
        if not self.cap_tokens:
            return super().max_memory_usage_bytes(vllm_config)
        tokens = min(self.cap_tokens, vllm_config.model_config.max_model_len)
        return cdiv(tokens, self.block_size) * self.page_size_bytes


class EpiKVAttentionManager(FullAttentionManager):
    """Full-attention blocks, counted against the cap: a request stops growing at its cap."""

    def _capped(self, num_tokens: int) -> int:
        cap = getattr(self.kv_cache_spec, "cap_tokens", 0)
        return min(num_tokens, cap) if cap else num_tokens

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._capped(num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> Any:
        return super().allocate_new_blocks(
            request_id, self._capped(num_tokens), self._capped(num_tokens_main_model)
        )

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        if getattr(self.kv_cache_spec, "cap_tokens", 0):
            raise RuntimeError("epikv: prefix caching must be off for an evicting policy")
        super().cache_blocks(request, num_tokens)


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


def group_caps(specs: Sequence[Any]) -> list[int]:
    """The caps of a KV cache config's group specs (0 where a group has none)."""
    out = []
    for spec in specs:
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        values = inner.values() if isinstance(inner, dict) else [spec]
        out.extend(getattr(s, "cap_tokens", 0) for s in values)
    return out


class EpiKVScheduler(Scheduler):
    """vLLM's scheduler with admission by K + tau: at most ``usable blocks // cap blocks`` requests run
    at once, so the pool never runs dry and an evicting request is never preempted."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.epikv_counters: dict[str, tuple[int, int, int]] = {}  # req_id -> the worker's latest
        caps = [c for c in group_caps([g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]) if c]
        self.epikv_cap = max(caps) if caps else 0
        if not self.epikv_cap:
            return
        block = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.epikv_cap_blocks = cdiv(self.epikv_cap, block)
        usable = kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block
        limit = usable // self.epikv_cap_blocks
        if limit < 1:
            raise ValueError(
                f"epikv: the KV pool has {usable} blocks of {block} tokens, fewer than one request's "
                f"K + tau = {self.epikv_cap} tokens ({self.epikv_cap_blocks} blocks)"
            )
        self.max_num_running_reqs = min(self.max_num_running_reqs, limit)
        self.max_num_active_reqs = min(self.max_num_active_reqs, limit)
        log.info(
            "epikv: each request holds at most %d tokens (%d blocks of %d); %d requests run at once",
            self.epikv_cap,
            self.epikv_cap_blocks,
            block,
            self.max_num_active_reqs,
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update, plus each request's counters from the worker; a finished request's output
        carries them as ``kv_transfer_params["epikv"]`` (no KV connector runs beside the plugin, and
        vLLM hands that field through to ``RequestOutput`` and the OpenAI response)."""
        report = getattr(model_runner_output, "epikv", None) or {}
        counters = self.epikv_counters
        counters.update(report)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for batch in outputs.values():
            for out in batch.outputs:
                if out.finish_reason is None or out.request_id not in counters:
                    continue
                peak, evicted, compactions = counters.pop(out.request_id)
                stats = {"peak_cache_tokens": peak, "evictions": evicted, "compactions": compactions}
                out.kv_transfer_params = {**(out.kv_transfer_params or {}), "epikv": stats}
        return outputs

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        if self.epikv_cap and out.preempted_req_ids:
            raise RuntimeError(
                f"epikv: requests {sorted(out.preempted_req_ids)} were preempted; an evicting request "
                "cannot be re-prefilled from its compacted cache (admission by K + tau should prevent this)"
            )
        return out
