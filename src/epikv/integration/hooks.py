"""Hooks that attach a budgeted cache to a model for the duration of a `with` block.

It attaches a :class:`~epikv.cache.BudgetedCache` to a causal LM through public seams only:
forward hooks installed by a context manager that always removes them, and the ``cache`` argument
of the model's forward / ``generate``. A pre-hook on the decoder stack gives each step true positions
and the cache's padding mask; hooks on the band layers capture their output hidden states for the
new tokens only; a post-hook hands the signals to the cache, which may then compact. The model keeps
its attention implementation (SDPA, FlashAttention): nothing here asks for attention weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epikv.cache import BudgetedCache
from epikv.integration.arch import (
    base_model,
    check_supported,
    decoder_layers,
    model_info,
    project_queries,
    text_config,
)
from epikv.integration.attention import AttentionCapture
from epikv.policies import Policy, get_policy
from epikv.policies.base import StepSignals


def resolve_policy(model: nn.Module, policy: str | Policy, **params: Any) -> Policy:
    """The policy with its parameters and model-dependent defaults (bands) filled in."""
    return get_policy(policy, **params).resolve(model_info(model))


class attach:
    """Attach a budgeted cache and its hooks to ``model`` for the duration of a ``with`` block.

    ``attention`` chooses where attention rows come from for policies that need them: ``recompute``
    (beside the fused kernel, the default) or ``eager`` (the model runs eager attention while
    attached). Inside the block pass the returned cache to ``model(..., cache=cache)`` or
    ``model.generate(..., past_key_values=cache)``; one cache serves one generation (call
    ``cache.reset()`` before reusing it). All hooks are removed on exit, even after an error.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: str | Policy = "epikv",
        budget: int | None = None,
        interval: int | None = None,
        attention: str = "recompute",
        **params: Any,
    ) -> None:
        self.spec = check_supported(model)
        self.model = model
        info = model_info(model)
        self.policy = resolve_policy(model, policy, **params)
        needs = self.policy.needs()
        self.attention = (
            AttentionCapture(model, self.spec, needs.attention_layers, needs.attention_queries, attention)
            if needs.attention_layers
            else None
        )
        self.attention_mode = attention if needs.attention_layers else None
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
        base = base_model(self.model)
        self._handles.append(base.register_forward_pre_hook(self._before, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._after, with_kwargs=True))
        layers = decoder_layers(self.model)
        for index in self.policy.needs().hidden_layers:
            self._handles.append(layers[index].register_forward_hook(self._capture(index)))
        if self.attention is not None:
            self._handles.extend(self.attention.install())
        return self.cache

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hidden.clear()
        if self.attention is not None:
            self.attention.restore()

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
        if self.attention is not None:
            self.attention.active = True
        kwargs["position_ids"] = positions
        kwargs["attention_mask"] = self.cache.valid.long() if self.cache.has_holes else None
        return args, kwargs

    def _capture(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._step is not None:
                hidden = (output[0] if isinstance(output, tuple) else output).detach()
                # At prefill only the last prompt row is kept: policies read nothing else there,
                # and holding the whole (B, P, hidden) output would add to peak prefill memory.
                self._hidden[index] = hidden[:, -1:] if self._step[2] else hidden

        return hook

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self._step is None or not self._ours(kwargs):
            return
        new_valid, positions, prefill = self._step
        self._step = None
        signals = StepSignals(
            hidden=dict(self._hidden), valid=new_valid, positions=positions, prefill=prefill
        )
        self._hidden.clear()
        if self.attention is not None:
            self.attention.active = False
            keys = {i: self.cache.layers[i].keys for i in self.attention.layers}
            signals.attention, signals.attention_colsum = self.attention.collect(
                keys, self.cache.valid, new_valid
            )
        with torch.no_grad():
            self.cache.end_step(signals)


def active_hooks(model: nn.Module) -> int:
    """Number of forward hooks on the decoder stack and its layers (0 once every attach has exited)."""
    modules = [base_model(model), *decoder_layers(model)]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


def attention_implementation(model: nn.Module) -> str:
    return str(text_config(model)._attn_implementation)
