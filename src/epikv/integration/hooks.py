"""Hooks that attach a budgeted cache to a model for the duration of a `with` block.

It feeds :class:`~epikv.cache.BudgetedCache` objects from a causal LM through public seams only:
forward hooks installed by a context manager that always removes them, and the ``cache`` argument
of the model's forward / ``generate``. A pre-hook on the decoder stack gives each step true positions
and the cache's padding mask; hooks on the band layers capture their output hidden states for the
new tokens only; a post-hook hands the signals to the cache, which may then compact. The model keeps
its attention implementation (SDPA, FlashAttention): nothing here asks for attention weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from epikv.cache import BudgetedCache
from epikv.integration import kernels, masks
from epikv.integration.arch import check_supported, decoder_layers, model_info
from epikv.integration.arch import project_queries as _project_queries
from epikv.integration.attention import AttentionCapture
from epikv.policies import Policy
from epikv.policies.base import StepSignals
from epikv.querypath import base_model, text_config
from epikv.spec import CacheSpec


def build_spec(
    model: nn.Module,
    policy: str | Policy | CacheSpec = "epikv",
    budget: int | str | None = None,
    *,
    interval: int | None = None,
    attention: str = "recompute",
    params: Mapping[str, Any] | Sequence[str] | None = None,
    rank_every: int | str | None = None,
) -> CacheSpec:
    """:meth:`CacheSpec.build` for a model (a spec passed in is returned as it is)."""
    if isinstance(policy, CacheSpec):
        return policy
    check_supported(model)
    return CacheSpec.build(
        model_info(model), policy, budget, interval=interval, attention=attention, params=params,
        rank_every=rank_every,
    )  # fmt: skip


class Attachment:
    """The hooks that feed every :class:`BudgetedCache` of one spec on one model.

    Enter it (re-entrant) to install the hooks, leave it to remove them; caches made by
    :meth:`new_cache` are served whenever they are passed to the model's forward, and any other cache
    is ignored, so several attachments (policies) can take turns on one model.
    """

    def __init__(self, model: nn.Module, spec: CacheSpec) -> None:
        self.arch = check_supported(model)
        self.model = model
        self.spec = spec
        self.info = model_info(model)
        if self.info.sliding_layers:
            masks.check_implementation(model)
            windowed = sorted(set(spec.policy.needs().attention_layers) & set(self.info.sliding_layers))
            if windowed:
                raise ValueError(
                    f"policy {spec.policy.name!r} reads attention of sliding-window layers {windowed}"
                )
        needs = spec.policy.needs()
        self.attention = (
            AttentionCapture(
                model, self.arch, needs.attention_layers, needs.attention_queries, spec.attention
            )
            if needs.attention_layers
            else None
        )
        self._handles: list[Any] = []
        self._previous_impl: str | None = None
        self._depth = 0
        self._hidden: dict[int, torch.Tensor] = {}
        self._step: tuple[BudgetedCache, torch.Tensor, torch.Tensor, bool] | None = None

    def new_cache(
        self, budget: int | None = None, *, max_slots: int | None = None, dtype: torch.dtype | None = None
    ) -> BudgetedCache:
        """An empty cache of this spec fed by these hooks (``budget`` narrows the spec's K; ``max_slots``
        caps its arena, a KV pool; ``dtype`` is the KV dtype, the model's unless set)."""
        weight = next(self.model.parameters())
        cache = BudgetedCache(
            self.spec,
            self.info,
            budget,
            dtype=dtype or weight.dtype,
            device=weight.device,
            max_slots=max_slots,
        )
        cache.project_queries = self.project
        cache.owner = self
        return cache

    def project(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return _project_queries(self.model, self.arch, layer, hidden, positions)

    @property
    def installed(self) -> bool:
        return self._depth > 0

    def __enter__(self) -> Attachment:
        self._depth += 1
        if self._depth == 1:
            self._install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._remove()

    def _install(self) -> None:
        if attention_implementation(self.model) == "sdpa":  # one-token steps on packed query groups
            self._previous_impl = "sdpa"
            self.model.set_attn_implementation(kernels.register())
        base = base_model(self.model)
        self._handles.append(base.register_forward_pre_hook(self._before, with_kwargs=True))
        self._handles.append(base.register_forward_hook(self._after, with_kwargs=True))
        layers = decoder_layers(self.model)
        for index in self.spec.policy.needs().hidden_layers:
            self._handles.append(layers[index].register_forward_hook(self._capture(index)))
        if self.attention is not None:
            self._handles.extend(self.attention.install())

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hidden.clear()
        self._step = None
        if self.attention is not None:
            self.attention.restore()
        if self._previous_impl is not None:
            self.model.set_attn_implementation(self._previous_impl)
            self._previous_impl = None

    # -- hooks -----------------------------------------------------------------------------------
    def _ours(self, kwargs: dict[str, Any]) -> BudgetedCache | None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        return cache if isinstance(cache, BudgetedCache) and cache.owner is self else None

    def _before(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        cache = self._ours(kwargs)
        if cache is None:
            return None
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs.get("inputs_embeds")
        batch, q = x.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError("a budgeted cache needs a 2D attention mask (or none), got a 4D mask")
        ones = torch.ones(batch, q, dtype=torch.bool, device=x.device)
        new_valid = mask[:, -q:].bool() if (mask is not None and not cache.started) else ones
        prefill = cache.in_prefill
        positions = cache.next_positions(new_valid)
        cache.begin_step(new_valid, positions)
        self._step = (cache, new_valid, positions, prefill)
        if self.attention is not None:
            self.attention.active = True
        kwargs["position_ids"] = positions
        if cache.windows is not None:  # one mask per layer kind, the window's by true position
            kwargs["attention_mask"] = masks.hybrid_masks(self.model, cache, positions)
        else:
            kwargs["attention_mask"] = cache.valid.long() if cache.has_holes else None
        return args, kwargs

    def _capture(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._step is not None:
                hidden = (output[0] if isinstance(output, tuple) else output).detach()
                # At prefill only the last prompt row is kept: policies read nothing else there.
                # A copy, not a view: a view holds the whole (B, P, hidden) output to the end of the
                # forward (and, in a policy's state, past it): 2 x P x hidden more at peak.
                self._hidden[index] = hidden[:, -1:].clone() if self._step[3] else hidden

        return hook

    def _after(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self._step is None or self._ours(kwargs) is None:
            return
        cache, new_valid, positions, prefill = self._step
        self._step = None
        signals = StepSignals(
            hidden=dict(self._hidden), valid=new_valid, positions=positions, prefill=prefill
        )
        self._hidden.clear()
        if self.attention is not None:
            self.attention.active = False
            keys = {i: cache.layers[i].keys for i in self.attention.layers}
            signals.attention, signals.attention_colsum = self.attention.collect(keys, cache.valid, new_valid)
        with torch.no_grad():
            cache.end_step(signals)


class attach:
    """Attach a budgeted cache and its hooks to ``model`` for the duration of a ``with`` block.

    ``policy`` is a name, a policy instance or a ready :class:`CacheSpec`; ``attention`` chooses
    where attention rows come from for policies that need them: ``recompute`` (beside the fused
    kernel, the default) or ``eager`` (the model runs eager attention while attached). Inside the
    block pass the returned cache to ``model(...)`` or ``model.generate(...)`` as ``cache=cache``
    (``past_key_values=cache`` on transformers 5.19, where ``cache`` is not yet its name;
    :func:`epikv.integration.compat.cache_kwargs` picks it); one cache serves one generation (call
    ``cache.reset()`` before reusing it). All hooks are removed on exit, even after an error.
    """

    def __init__(
        self,
        model: nn.Module,
        policy: str | Policy | CacheSpec = "epikv",
        budget: int | str | None = None,
        interval: int | None = None,
        attention: str = "recompute",
        **params: Any,
    ) -> None:
        spec = build_spec(model, policy, budget, interval=interval, attention=attention, params=params)
        self.attachment = Attachment(model, spec)
        self.spec, self.policy = spec, spec.policy
        self.cache = self.attachment.new_cache()

    def __enter__(self) -> BudgetedCache:
        self.attachment.__enter__()
        return self.cache

    def __exit__(self, *exc: object) -> None:
        self.attachment.__exit__(*exc)


def active_hooks(model: nn.Module) -> int:
    """Number of forward hooks on the decoder stack and its layers (0 once every attach has exited)."""
    modules = [base_model(model), *decoder_layers(model)]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


def attention_implementation(model: nn.Module) -> str:
    return str(text_config(model)._attn_implementation)
