"""Tiny random-weight causal LMs: the tests' models and the benchmarks' ``random:`` presets.

Owns the one shape they share (4 layers, 4 query heads over 2 KV heads, hidden 64, vocabulary 97:
small enough for a CPU test, GQA like the real models) and building a model with seeded random
weights from a config. Knows no caller: each passes its own overrides and identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from epikv.models.identity import set_identity

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
"""Config values every tiny model starts from (any of them can be overridden)."""

_TINY_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_TINY_HYBRID: dict[str, Any] = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    # Qwen2's config enables a sliding window unless told not to, and the budgeted cache refuses one.
    "qwen2": {"use_sliding_window": False},
    "mistral": {"sliding_window": None},
    "qwen3_moe": {**_TINY_MOE, "num_experts": 4},
    # Phi-4-mini's partial RoPE (3/4 of each head rotated); token ids inside the tiny vocabulary.
    "phi3": {"partial_rotary_factor": 0.75, "pad_token_id": None, "eos_token_id": 2},
    "olmo2": {"eos_token_id": 2},
    # GLM-4.5's query/key norms; its partial RoPE (half of each head) is the config's default.
    "glm4_moe": {**_TINY_MOE, "n_routed_experts": 4, "use_qk_norm": True},
    "seed_oss": {"head_dim": 16},
    # The hybrids: a sliding window of 6 in layers 0 and 2 (the real models start with sliding layers),
    # global layers 1 and 3, so a test of a few dozen tokens runs past the window.
    "gemma3_text": {
        **_TINY_HYBRID,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "olmo3": {**_TINY_HYBRID, "eos_token_id": 2, "pad_token_id": 0},
    "gpt_oss": {
        **_TINY_HYBRID,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "eos_token_id": 2,
        "pad_token_id": 0,
    },
    "exaone4": {**_TINY_HYBRID, "sliding_window_pattern": 2, "eos_token_id": 2, "pad_token_id": 0},
    # SmolLM3: every fourth layer without RoPE (layer 3 here), all global.
    "smollm3": {"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1},
}
_ATTENTION = {"gpt_oss": "eager"}  # gpt-oss's learned sinks run in its own eager attention


def tiny_spec(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The tiny config as plain values, ``model_type`` included (what ``AutoConfig.for_model`` takes)."""
    return {"model_type": arch, **TINY_SHAPE, **_ARCH_DEFAULTS.get(arch, {}), **overrides}


def config_from_spec(spec: dict[str, Any]) -> PretrainedConfig:
    """A transformers config from plain values with a ``model_type`` key, using sdpa attention."""
    from transformers import AutoConfig

    values = dict(spec)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = _ATTENTION.get(spec["model_type"], "sdpa")
    return config


def tiny_config(arch: str = "llama", **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``arch`` (any transformers ``model_type``), with ``overrides`` applied."""
    return config_from_spec(tiny_spec(arch, **overrides))


def random_weights(
    config: PretrainedConfig,
    seed: int = 0,
    *,
    identity: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> PreTrainedModel:
    """A causal LM of ``config`` with weights drawn after ``torch.manual_seed(seed)``, in eval mode.

    ``identity`` names it for :func:`epikv.models.model_identity` (and is saved with its config);
    ``None`` leaves it unnamed.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if identity is not None:
        set_identity(model, identity)
    return model.eval()


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    *,
    identity: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny random-weight model: :func:`tiny_config` built by :func:`random_weights`."""
    return random_weights(tiny_config(arch, **overrides), seed, identity=identity, dtype=dtype, device=device)
