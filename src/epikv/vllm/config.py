"""The plugin's settings: what ``additional_config["epikv"]`` may hold, the run spec built from it for
the served model, and every configuration the plugin refuses, each with one line saying why.

Knows vLLM only through the config object handed in (read with ``getattr``), so the checks are
testable without an engine.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec

KEY = "epikv"  # the key of ``additional_config`` the plugin reads
WORKER = "epikv.vllm.runner.EpiKVCPUWorker"
SCHEDULER = "epikv.vllm.scheduler.EpiKVScheduler"
SUPPORTED_VLLM = ("0.32.",)  # the private runner methods overridden are pinned to this series


class Refused(RuntimeError):
    """A configuration the plugin cannot run; the message is one line saying what and why."""


@dataclass(frozen=True)
class EpiKVSettings:
    """policy: an epikv policy name; budget: K tokens per request (None for ``full``); interval: tau
    (None = the policy's own); params: policy hyperparameters; trace: a JSONL file the worker
    appends each compaction's kept positions to (tests and studies; None = off)."""

    policy: str = "epikv"
    budget: int | None = None
    interval: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any] | None) -> EpiKVSettings | None:
        """The settings in ``additional_config`` (None when it has no ``epikv`` entry)."""
        if not raw or KEY not in raw:
            return None
        value = raw[KEY]
        if not isinstance(value, Mapping):
            raise Refused(f"additional_config['{KEY}'] must be a mapping, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise Refused(f"additional_config['{KEY}']: unknown key {unknown[0]!r}{hint}; known: {known}")
        params = value.get("params") or {}
        if not isinstance(params, Mapping):
            raise Refused(f"additional_config['{KEY}']['params'] must be a mapping, got {params!r}")
        return cls(
            policy=str(value.get("policy", cls.policy)),
            budget=value.get("budget"),
            interval=value.get("interval"),
            params=dict(params),
            trace=value.get("trace"),
        )

    def as_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        for name in ("budget", "interval", "trace"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.params:
            out["params"] = dict(self.params)
        return out

    def spec(self, model: ModelInfo) -> CacheSpec:
        """The run spec for the served model; refuses policies that read attention rows."""
        try:
            spec = CacheSpec.build(
                model, self.policy, self.budget, interval=self.interval, params=self.params
            )
        except ValueError as err:
            raise Refused(f"epikv: {err}") from err
        if spec.policy.needs().attention_layers:
            raise Refused(
                f"epikv: policy {spec.policy.name!r} reads attention weights, which vLLM's fused attention "
                "kernels never produce (EpiKV's point); use one that needs none: "
                + ", ".join(vllm_policies())
            )
        return spec


def vllm_policies() -> list[str]:
    """The policies the plugin runs: every one that needs no attention matrix."""
    from epikv.policies import policy_class, policy_names

    return [n for n in policy_names() if "attention_weights" not in policy_class(n).requires]


def cap_tokens(spec: CacheSpec) -> int | None:
    """The most physical tokens a request ever holds: K + tau (None: ``full`` never evicts)."""
    return None if spec.budget is None else spec.budget + spec.interval


def check_prompt_fits(spec: CacheSpec, tokens: int) -> None:
    """Raise ValueError unless a prompt of ``tokens`` can run: its protected tokens fit K, and it fits
    the K + tau slots its blocks are capped at (nothing to check for ``full``)."""
    cap = cap_tokens(spec)
    if cap is None:
        return
    spec.check_prompt(tokens)
    if tokens > cap:
        raise ValueError(f"epikv: a prompt of {tokens} tokens is longer than K + tau = {cap} tokens")


def model_info(vllm_config: Any) -> ModelInfo:
    """What a policy may know of the served model, from vLLM's model config."""
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    heads = hf.num_attention_heads
    identity = getattr(model_config.hf_config, "epikv_model_id", None) or str(model_config.model)
    return ModelInfo(
        identity=identity,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        hidden_size=hf.hidden_size,
        context_length=getattr(hf, "max_position_embeddings", None),
    )


def check_engine(vllm_config: Any, spec: CacheSpec) -> None:
    """Refuse, with one line, what the plugin does not run (yet)."""
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise Refused(
            f"epikv: vLLM {vllm.__version__} is not supported (tested on {SUPPORTED_VLLM[0]}x; the worker "
            "overrides private methods of its model runner)"
        )
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel, scheduler = vllm_config.parallel_config, vllm_config.scheduler_config
    hf = model.hf_text_config
    checks = [
        (
            cache.enable_prefix_caching,
            "prefix caching is on: pass --no-enable-prefix-caching "
            "(enable_prefix_caching=False); a compacted request's blocks no longer hold their prefix",
        ),
        (vllm_config.speculative_config is not None, "speculative decoding is not supported"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism is not supported"),
        (
            parallel.tensor_parallel_size > 1,
            "tensor parallelism is not built yet (docs/vllm.md); "
            "use data parallelism (--data-parallel-size) for more replicas",
        ),
        (
            str(cache.cache_dtype) != "auto",
            f"KV cache dtype {cache.cache_dtype!r}: quantized or fp8 KV "
            "is not supported (the layout probe needs exact values)",
        ),
        (
            bool(getattr(model, "use_mla", False)),
            "models with multi-head latent attention (MLA) are not supported yet",
        ),
        (
            _has_window(hf),
            "models with sliding-window layers are not supported in vLLM yet (they are in "
            "epikv's own engine)",
        ),
        (bool(getattr(scheduler, "async_scheduling", False)), "async scheduling is not supported"),
        (vllm_config.kv_transfer_config is not None, "KV connectors are not supported"),
    ]
    for bad, why in checks:
        if bad:
            raise Refused(f"epikv: {why}")
    if spec.policy.needs().query_layer is not None and model.hf_config.model_type not in QUERY_MODELS:
        raise Refused(
            f"epikv: policy {spec.policy.name!r} recomputes queries, built for model types "
            f"{sorted(QUERY_MODELS)} in vLLM, not {model.hf_config.model_type!r}"
        )


QUERY_MODELS = {"llama", "mistral", "qwen2"}  # q = rope(q_proj(input_norm(h))), no query norm


def _has_window(hf: Any) -> bool:
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        return True
    return any(kind != "full_attention" for kind in (getattr(hf, "layer_types", None) or []))
