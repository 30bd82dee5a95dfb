"""EpiKV inside vLLM: a plugin (``vllm.general_plugins``) that keeps each request's KV cache within
K + tau tokens with epikv's own policies, on vLLM's unmodified attention kernels.

In Python::

    llm = vllm.LLM(model, **epikv.vllm.engine_kwargs(policy="epikv", budget=1024), dtype="bfloat16")

From the command line: ``vllm serve MODEL --additional-config '{"epikv": {"policy": "epikv",
"budget": 1024}}'`` (docs/vllm.md). This module imports nothing
from vLLM, so ``engine_kwargs`` works before vLLM is imported.
"""

from __future__ import annotations

from typing import Any

from epikv.vllm.config import KEY, SCHEDULER, WORKER, EpiKVSettings, vllm_policies

__all__ = ["KEY", "SCHEDULER", "WORKER", "EpiKVSettings", "engine_kwargs", "vllm_policies"]


def engine_kwargs(
    policy: str = "epikv",
    budget: int | None = None,
    interval: int | None = None,
    rank_every: int | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Everything ``vllm.LLM`` / ``EngineArgs`` need to run ``policy`` at budget K = ``budget``:
    the additional config, the plugin's worker and scheduler classes, and prefix caching off for a
    policy that may evict prompt tokens (vLLM's default, on, for one that protects the prompt).
    ``rank_every``: rho (:attr:`epikv.spec.CacheSpec.rank_every`, docs/vllm.md); ``params`` are policy
    hyperparameters (``trace=PATH`` writes each compaction's kept positions).
    The caller's own keyword arguments (dtype, kv_cache_memory_bytes, enforce_eager, ...) go beside."""
    from epikv.policies import policy_class
    from epikv.spec import parse_policy_params

    trace = params.pop("trace", None)
    settings = EpiKVSettings(policy, budget, interval, dict(params), trace, rank_every=rank_every)
    out: dict[str, Any] = {
        "additional_config": {KEY: settings.as_config()},
        "worker_cls": WORKER,
        "scheduler_cls": SCHEDULER,
    }
    kind = policy_class(policy)
    chosen = kind(**parse_policy_params(kind, params))
    if chosen.evicts and not chosen.protect_prompt:  # its prompt blocks may change: no sharing
        out["enable_prefix_caching"] = False
    return out
