"""The plugin's start-up refusals: what it does not run (yet), each refused in one line when vLLM
builds its config or its worker, never at the first compaction (listed in docs/vllm.md, "Refused,
with one line each")."""

from __future__ import annotations

from typing import Any

from epikv.archs import ARCHITECTURES, window_problem
from epikv.spec import CacheSpec
from epikv.vllm.config import Refused
from epikv.vllm.pins import version_refusal


def check_engine(vllm_config: Any, spec: CacheSpec) -> None:
    """Refuse, with one line, what the plugin does not run (yet): at start-up, never at the first
    compaction."""
    import vllm
    from vllm.platforms import current_platform

    refusal = version_refusal(vllm.__version__)
    if refusal is not None:
        raise Refused(refusal)
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel, scheduler = vllm_config.parallel_config, vllm_config.scheduler_config
    hf = model.hf_text_config
    evicts, queries = spec.evicts, spec.policy.needs().query_layer is not None
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    window = window_problem(hf, model.hf_config.model_type)
    checks = [
        (
            not current_platform.is_cpu(),
            f"the {current_platform.device_name} platform is not supported: the plugin runs on vLLM's CPU "
            "backend (the GPU path is designed in docs/vllm.md, not built)",
        ),
        (
            evicts and cache.enable_prefix_caching and not spec.policy.protect_prompt,
            f"prefix caching is on, and policy {spec.policy.name!r} may evict prompt tokens, so a prompt's "
            "blocks could change under another request: pass --no-enable-prefix-caching "
            "(enable_prefix_caching=False) or use a policy that protects the prompt",
        ),
        (vllm_config.speculative_config is not None, "speculative decoding is not supported"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism is not supported"),
        (
            (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
            % parallel.tensor_parallel_size
            != 0,
            f"tensor parallelism {parallel.tensor_parallel_size} does not divide the model's {kv_heads} KV "
            "heads: vLLM would replicate heads across ranks, which the plugin does not gather",
        ),
        (
            str(cache.cache_dtype) != "auto",
            f"KV cache dtype {cache.cache_dtype!r}: quantized or fp8 KV "
            "is not supported (the layout probe needs exact values)",
        ),
        (
            bool(model.use_mla),
            "models with multi-head latent attention (MLA) are not supported yet",
        ),
        (window is not None, str(window)),
        (
            evicts and _uses_alibi(model),
            "ALiBi models are not supported: vLLM's kernels would bias by physical slots, so every "
            "distance is wrong once tokens are evicted",
        ),
        (
            bool(model.enable_prompt_embeds),
            "prompt embeddings are not supported (--enable-prompt-embeds): the plugin protects and "
            "counts a prompt by its token ids",
        ),
        (bool(scheduler.async_scheduling), "async scheduling is not supported"),
        (vllm_config.kv_transfer_config is not None, "KV connectors are not supported"),
        (
            queries and vllm_config.lora_config is not None,
            f"policy {spec.policy.name!r} recomputes queries, which LoRA adapters would change: "
            "LoRA is not supported with it",
        ),
        (
            queries and model.quantization is not None,
            f"policy {spec.policy.name!r} recomputes queries through the query projection, which is not "
            f"built for {model.quantization!r} weights; use an unquantized model or a policy without "
            "queries",
        ),
    ]
    for bad, why in checks:
        if bad:
            raise Refused(f"epikv: {why}")
    if spec.policy.needs().hidden_layers and not _has_aux_hidden_states(model):
        raise Refused(
            f"epikv: policy {spec.policy.name!r} reads hidden states through vLLM's EAGLE-3 aux-hidden-"
            f"state path, which vLLM's class for {model.architectures} does not have; run the model on "
            "vLLM's Transformers backend, which has it (--model-impl transformers), or use a policy that "
            "reads none (streaming, keydiff, lagkv, random)"
        )
    kind = model.hf_config.model_type
    native = kind in QUERY_MODELS or (kind in ARCHITECTURES and _on_transformers_backend(model))
    if queries and not native:
        raise Refused(
            f"epikv: policy {spec.policy.name!r} recomputes queries, built for model types "
            f"{sorted(QUERY_MODELS)} in vLLM, not {kind!r}"
        )


QUERY_MODELS = frozenset(
    name
    for name, facts in ARCHITECTURES.items()
    if not facts.rope_by_layer_type and facts.rope_flag is None and not facts.nope_global
)
"""Model types whose queries the plugin recomputes with vLLM's own modules (:mod:`epikv.vllm.queries`):
every layer applies its own RoPE module. Left out: per-layer-kind tables and layers without RoPE
(Gemma 3, EXAONE 4), whose vLLM classes also lack the aux-hidden-state path Seg-Q reads. On vLLM's
Transformers backend the queries follow epikv's engine's path on transformers' modules, every type."""


ALIBI_MODELS = {"bloom", "mpt", "jais", "baichuan"}  # attention biased by distance, not RoPE


def _uses_alibi(model: Any) -> bool:
    hf = model.hf_text_config
    if getattr(hf, "alibi", False) or getattr(hf, "use_alibi", False):
        return True
    if getattr(hf, "position_embedding_type", None) == "alibi":
        return True
    kind = model.hf_config.model_type
    return kind in ALIBI_MODELS and (kind != "baichuan" or getattr(hf, "num_hidden_layers", 0) >= 40)


def _model_class(model: Any) -> type | None:
    """vLLM's class for the model (None when it cannot be resolved here: a stand-in config, or a class
    vLLM cannot load, which then fails on the model itself: not ours to refuse)."""
    try:
        from vllm.model_executor.models import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(model.architectures, model)
    except Exception:
        return None
    return cls


def _on_transformers_backend(model: Any) -> bool:
    cls = _model_class(model)
    return cls is not None and cls.__module__.startswith("vllm.model_executor.models.transformers")


def _has_aux_hidden_states(model: Any) -> bool:
    """Whether vLLM's class for the model has the EAGLE-3 aux-hidden-state path (True when the class
    cannot be resolved here)."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    cls = _model_class(model)
    return cls is None or bool(supports_eagle3(cls))
