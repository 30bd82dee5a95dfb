"""The one module that touches transformers internals: architecture table, hooks, query projection.

It attaches a :class:`~epikv.cache.BudgetedCache` to a causal LM through public seams only:
forward hooks installed by a context manager that always removes them, and the ``cache`` argument
of the model's forward / ``generate``. A pre-hook on the decoder stack gives each step true positions
and the cache's padding mask; hooks on the band layers capture their output hidden states for the
new tokens only; a post-hook hands the signals to the cache, which may then compact. The model keeps
its attention implementation (SDPA, FlashAttention): nothing here asks for attention weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epikv.cache import BudgetedCache
from epikv.policies import Policy, get_policy
from epikv.policies.base import ModelInfo, StepSignals


@dataclass(frozen=True)
class ArchSpec:
    """Where an architecture keeps what the hooks need."""

    q_norm: str | None = None  # per-head query norm applied before RoPE (Qwen3)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(),
    "qwen2": ArchSpec(),
    "qwen3": ArchSpec(q_norm="q_norm"),
}


def _text_config(model: nn.Module) -> Any:
    return model.config.get_text_config(decoder=True)


def check_supported(model: nn.Module) -> ArchSpec:
    """The architecture's spec, or a clear error for models the cache would get silently wrong."""
    config = _text_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported by epikv (supported: {', '.join(sorted(ARCHITECTURES))}); "
            "eviction needs RoPE attention without sliding windows"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types)
    window = getattr(config, "sliding_window", None)
    if sliding or (window is not None and getattr(config, "use_sliding_window", True)):
        raise ValueError(
            f"model type {model_type!r} with sliding-window layers (sliding_window={window}) is not supported: "
            "a window over compacted slots would mask the wrong tokens"
        )
    if getattr(_base_model(model), "rotary_emb", None) is None:
        raise ValueError(f"model type {model_type!r} has no rotary embedding; true positions cannot be kept")
    return ARCHITECTURES[model_type]


def _base_model(model: nn.Module) -> nn.Module:
    return getattr(model, getattr(model, "base_model_prefix", "model"), model)


def _layers(model: nn.Module) -> nn.ModuleList:
    return _base_model(model).layers


def model_info(model: nn.Module) -> ModelInfo:
    config = _text_config(model)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    identity = getattr(model, "epikv_identity", None) or getattr(config, "_name_or_path", "") or "unknown"
    return ModelInfo(
        identity=str(identity),
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def project_queries(
    model: nn.Module, spec: ArchSpec, layer: int, hidden: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Queries of ``layer`` for residual states ``hidden`` (B, W, hidden) entering it, with RoPE at
    ``positions`` (B, W): the layer's own input norm, query projection (and Qwen3's q_norm), then
    RoPE. Returns (B, Hq, W, head_dim)."""
    decoder = _layers(model)[layer]
    attn = decoder.self_attn
    info = model_info(model)
    with torch.no_grad():
        x = decoder.input_layernorm(hidden.to(attn.q_proj.weight.dtype))
        q = attn.q_proj(x).view(*hidden.shape[:2], -1, info.head_dim)
        if spec.q_norm is not None:
            q = getattr(attn, spec.q_norm)(q)
        q = q.transpose(1, 2)
        cos, sin = _base_model(model).rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + _rotate_half(q) * sin


def resolve_policy(model: nn.Module, policy: str | Policy, **params: Any) -> Policy:
    """The policy with its parameters and model-dependent defaults (bands) filled in."""
    return get_policy(policy, **params).resolve(model_info(model))


class attach:  # noqa: N801 - used like a function: ``with attach(model, "epikv", budget=1024) as cache``
    """Attach a budgeted cache and its hooks to ``model`` for the duration of a ``with`` block.

    Inside the block pass the returned cache to ``model(..., cache=cache)`` or
    ``model.generate(..., past_key_values=cache)``; one cache serves one generation (call
    ``cache.reset()`` before reusing it). All hooks are removed on exit, even after an error.
    """

    def __init__(
        self, model: nn.Module, policy: str | Policy = "epikv", budget: int | None = None,
        interval: int | None = None, **params: Any,
    ) -> None:
        self.spec = check_supported(model)
        self.model = model
        info = model_info(model)
        self.policy = resolve_policy(model, policy, **params)
        if self.policy.evicts and budget is None:
            raise ValueError(f"policy {self.policy.name!r} evicts and needs a budget (tokens), got None")
        self.cache = BudgetedCache(self.policy, budget, info, interval)
        self.cache.project_queries = self._project
        self._handles: list[Any] = []
        self._hidden: dict[int, torch.Tensor] = {}
        self._step: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    def _project(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return project_queries(self.model, self.spec, layer, hidden, positions)

    def __enter__(self) -> BudgetedCache:
        base = _base_model(self.model)
        self._handles.append(base.register_forward_pre_hook(self._before, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._after, with_kwargs=True))
        layers = _layers(self.model)
        for index in self.policy.needs().hidden_layers:
            self._handles.append(layers[index].register_forward_hook(self._capture(index)))
        return self.cache

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hidden.clear()

    # -- hooks -----------------------------------------------------------------------------------
    def _ours(self, kwargs: dict[str, Any]) -> bool:
        return kwargs.get("cache", kwargs.get("past_key_values")) is self.cache

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if not self._ours(kwargs):
            return None
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs.get("inputs_embeds")
        batch, q = x.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError("a budgeted cache needs a 2D attention mask (or none), got a 4D mask")
        ones = torch.ones(batch, q, dtype=torch.bool, device=x.device)
        new_valid = mask[:, -q:].bool() if (mask is not None and not self.cache.started) else ones
        prefill = not self.cache.started
        positions = self.cache.next_positions(new_valid)
        self.cache.begin_step(new_valid, positions)
        self._step = (new_valid, positions, prefill)
        kwargs["position_ids"] = positions
        kwargs["attention_mask"] = self.cache.valid.long() if self.cache.has_holes else None
        return args, kwargs

    def _capture(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._step is not None:
                self._hidden[index] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self._step is None or not self._ours(kwargs):
            return
        new_valid, positions, prefill = self._step
        self._step = None
        signals = StepSignals(hidden=dict(self._hidden), valid=new_valid, positions=positions, prefill=prefill)
        self._hidden.clear()
        with torch.no_grad():
            self.cache.end_step(signals)


def active_hooks(model: nn.Module) -> int:
    """Number of forward hooks on the decoder stack and its layers (0 once every attach has exited)."""
    modules = [_base_model(model), *_layers(model)]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


def attention_implementation(model: nn.Module) -> str:
    return str(_text_config(model)._attn_implementation)


__all__ = ["ARCHITECTURES", "ArchSpec", "active_hooks", "attach", "attention_implementation", "check_supported",
           "model_info", "project_queries"]
