"""The architectures epikv evicts in, and how each computes a layer's queries: one table, read by
epikv's own engine (:mod:`epikv.integration.arch`, on transformers' modules) and by the vLLM plugin
(:mod:`epikv.vllm.queries`, on vLLM's). Plain data and one reader of a config's windows: no torch, no
transformers, no vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchFacts:
    """How an architecture computes a layer's queries: what Seg-Q and the attention baselines redo.

    Every supported architecture scales queries by 1/sqrt(head_dim) (checked on the model); its
    global layers evict, and sliding-window layers (``hybrid`` architectures) keep their own window
    (:mod:`epikv.cache.window`). The fields say where the query path differs from Llama's.
    """

    # decoder-layer norm in front of attention (None: OLMo-2 normalises after attention instead)
    input_norm: str | None = "input_layernorm"
    # attention module whose output starts with the queries
    q_proj: str = "q_proj"
    # q_proj yields queries, keys and values side by side (Phi-3): the queries are the first Hq*d
    fused_qkv: bool = False
    # query norm before RoPE, used when the module has one (GLM-4.5 builds it only with use_qk_norm)
    q_norm: str | None = None
    # q_norm spans all heads' projection before the head split (OLMo-2), rather than each head (Qwen3)
    q_norm_whole: bool = False
    # the model's rotary embedding takes the layer type (Gemma 3, OLMo-3: one table per layer kind)
    rope_by_layer_type: bool = False
    # rotary tables are half a head wide and rotate the two halves (gpt-oss), not rotate_half's layout
    half_tables: bool = False
    # attention attribute saying whether a layer applies RoPE (SmolLM3's NoPE layers: ``use_rope``)
    rope_flag: str | None = None
    # with a sliding window configured, only the sliding layers apply RoPE (EXAONE 4's global NoPE)
    nope_global: bool = False
    # per-head learned logits joining every softmax (gpt-oss): recomputed attention rows include them
    sinks: str | None = None
    # may interleave sliding-window layers with global ones (evict in global layers only)
    hybrid: bool = False
    # reasoning models people run with this model type (for `epikv policies --models`)
    examples: str = ""

    def query_path(self) -> str:
        """The query path in words, e.g. ``input_layernorm > q_proj > q_norm (per head) > RoPE``."""
        steps = [self.input_norm or "(no input norm)"]
        steps.append(f"{self.q_proj}[:Hq*d]" if self.fused_qkv else self.q_proj)
        if self.q_norm is not None:
            steps.append(f"{self.q_norm} ({'all heads' if self.q_norm_whole else 'per head'})")
        rope = "RoPE"
        if self.rope_flag is not None:
            rope = f"RoPE (where {self.rope_flag})"
        elif self.nope_global:
            rope = "RoPE (sliding layers only)"
        elif self.rope_by_layer_type:
            rope = "RoPE (table of the layer's kind)"
        steps.append(rope)
        if self.sinks is not None:
            steps.append(f"softmax with learned {self.sinks}")
        return " > ".join(steps)


def sliding_layers(config: Any) -> tuple[tuple[int, ...], int | None]:
    """The layers of a model's text config with a sliding window, and its width (the config's
    ``layer_types`` and ``sliding_window``; SmolLM3 names sliding layers but uses them only with
    ``use_sliding_window``). A config with a window and no layer types has it in every layer. Both
    hosts read a model's windows here: epikv's engine from transformers' config, the plugin from
    vLLM's (the same object)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return (), None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return tuple(range(config.num_hidden_layers)), window
    return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"), window


ARCHITECTURES: dict[str, ArchFacts] = {
    "llama": ArchFacts(examples="Llama 3, DeepSeek-R1-Distill-Llama"),
    "mistral": ArchFacts(examples="Mistral-family configs without a sliding window"),
    "qwen2": ArchFacts(examples="DeepSeek-R1-Distill-Qwen, QwQ-32B, Qwen2.5"),
    "qwen3": ArchFacts(q_norm="q_norm", examples="Qwen3 dense (0.6B-32B)"),
    "qwen3_moe": ArchFacts(q_norm="q_norm", examples="Qwen3-30B-A3B, Qwen3-235B-A22B"),
    "phi3": ArchFacts(q_proj="qkv_proj", fused_qkv=True, examples="Phi-4-reasoning, Phi-4-reasoning-plus"),
    "olmo2": ArchFacts(input_norm=None, q_norm="q_norm", q_norm_whole=True, examples="OLMo-2"),
    "glm4_moe": ArchFacts(q_norm="q_norm", examples="GLM-4.5, GLM-4.5-Air"),
    "seed_oss": ArchFacts(examples="Seed-OSS-36B"),
    "smollm3": ArchFacts(rope_flag="use_rope", hybrid=True, examples="SmolLM3-3B"),
    "gemma3_text": ArchFacts(
        q_norm="q_norm", rope_by_layer_type=True, hybrid=True, examples="Gemma 3 (270M-12B text)"
    ),
    "olmo3": ArchFacts(
        input_norm=None,
        q_norm="q_norm",
        q_norm_whole=True,
        rope_by_layer_type=True,
        hybrid=True,
        examples="OLMo-3-Think",
    ),
    "gpt_oss": ArchFacts(half_tables=True, sinks="sinks", hybrid=True, examples="gpt-oss-20b, gpt-oss-120b"),
    "exaone4": ArchFacts(
        input_norm=None, q_norm="q_norm", nope_global=True, hybrid=True, examples="EXAONE-4.0"
    ),
}
"""Partial RoPE (Phi-3's partial_rotary_factor, GLM-4.5's half-rotated heads) needs no field: the
model's rotary tables are only as wide as the rotated part, and :func:`apply_rope` rotates that much."""


def window_problem(config: Any, model_type: str) -> str | None:
    """Why a model's sliding windows cannot be kept, or None (both hosts refuse with this line): a
    hybrid of the table evicts in its global layers and keeps its sliding ones; any other model type
    with a window, layer kinds other than full and sliding, or a window in every layer is refused."""
    sliding, window = sliding_layers(config)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "sliding_attention"}:
        return f"model type {model_type!r} has layer types {sorted(kinds)}; epikv knows full and sliding"
    if not sliding:
        return None
    facts = ARCHITECTURES.get(model_type)
    if facts is None or not facts.hybrid:
        return (
            f"model type {model_type!r} with a sliding window (sliding_window={window}) is not supported: "
            "a window over compacted slots would mask the wrong tokens"
        )
    if len(sliding) == config.num_hidden_layers:
        return (
            f"model type {model_type!r} has a sliding window in every layer (sliding_window={window}): "
            "there is no global layer to evict in, its cache is already bounded"
        )
    return None


_MLA = (
    "uses multi-head latent attention (MLA): its cache holds one compressed latent per token, "
    "not per-head keys and values that eviction scores and keeps"
)
_RECURRENT = (
    "has state-space or linear-attention layers: their state is a running summary, "
    "not a cache of tokens to evict"
)
NOT_YET: dict[str, str] = {
    "gemma2": "caps attention logits (softcapping), which the recomputed attention rows do not model",
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash"), _MLA),
    **dict.fromkeys(
        "mamba mamba2 falcon_mamba falcon_h1 jamba bamba zamba zamba2 nemotron_h granitemoehybrid "
        "qwen3_next lfm2 lfm2_moe recurrent_gemma rwkv xlstm minimax kimi_linear olmo_hybrid "
        "bailing_hybrid".split(),
        _RECURRENT,
    ),
}
"""Model types refused with the reason (transformers 5.24 has all of them); others get the generic line."""

PROVEN = (
    "full == transformers' own cache, token for token (every policy, nothing evicted)",
    "every evicting policy: at most K + tau tokens between compactions, K after one",
    "a request in an engine batch yields its solo tokens (full, streaming, epikv-flat, epikv, h2o)",
    "true positions survive eviction (a kept set replayed at its positions gives the same logits)",
    "recomputed queries == the model's own; recomputed attention rows == eager attention",
)
"""What the tests prove for every entry of ARCHITECTURES on a tiny random-weight model built from its
config class (tests/conftest.py ``arch_model`` enrolls each entry; a new entry is tested as it lands)."""

HYBRID_PROVEN = (
    "full == transformers' own hybrid cache past the window, in a left-padded batch",
    "a sliding layer's ring holds exactly the last W tokens; only global layers evict",
    "a prompt prefilled in chunks == one pass (ring, then each chunk, masked by position)",
    "rings are counted in the KV pool: allocated bytes <= pool x bytes of a global-layer slot",
)
"""What tests/cache/test_window.py (and tests/cache/test_arena.py) add for the hybrid entries."""
