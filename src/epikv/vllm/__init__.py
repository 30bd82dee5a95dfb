"""EpiKV inside vLLM: a plugin (``vllm.general_plugins``) that keeps each request's KV cache within
K + tau tokens with epikv's own policies, on vLLM's unmodified attention kernels.

In Python::

    llm = vllm.LLM(model, **epikv.vllm.engine_kwargs(policy="epikv", budget=1024), dtype="bfloat16")

From the command line: ``vllm serve MODEL --no-enable-prefix-caching --additional-config
'{"epikv": {"policy": "epikv", "budget": 1024}}'`` (docs/vllm.md). This module imports nothing
from vLLM, so ``engine_kwargs`` works before vLLM is imported.
"""

from __future__ import annotations

from typing import Any

from epikv.vllm.config import KEY, SCHEDULER, WORKER, EpiKVSettings, vllm_policies

__all__ = ["KEY", "SCHEDULER", "WORKER", "EpiKVSettings", "engine_kwargs", "vllm_policies"]


def engine_kwargs(
    policy: str = "epikv", budget: int | None = None, interval: int | None = None, **params: Any
) -> dict[str, Any]:
    """Everything ``vllm.LLM`` / ``EngineArgs`` need to run ``policy`` at budget K = ``budget``:
    the additional config, the plugin's worker and scheduler classes, and prefix caching off.
    ``params`` are policy hyperparameters (``trace=PATH`` writes each compaction's kept positions).
    The caller's own keyword arguments (dtype, kv_cache_memory_bytes, enforce_eager, ...) go beside."""
    trace = params.pop("trace", None)
    settings = EpiKVSettings(policy, budget, interval, dict(params), trace)
    return {
        "additional_config": {KEY: settings.as_config()},
        "enable_prefix_caching": False,
        "worker_cls": WORKER,
        "scheduler_cls": SCHEDULER,
    }
