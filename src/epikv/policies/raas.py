"""``raas``: Reasoning-aware Attention Sparsity (Hu et al., ACL Findings 2025, arXiv 2502.11147).

"Milestone" tokens of a reasoning trace are attended for a while and then never again; "phoenix"
tokens (mostly the prompt) come back. RaaS keeps every prompt token and evicts generated tokens least
recently attended first. Each generated token carries a timestamp (the decode step that wrote it);
at every decode step, a generated token whose attention from the current query reaches the median
attention of the generated tokens in the cache at that step (``torch.nanmedian``: the lower middle
value for an even count) has its timestamp refreshed to the current step. The score is the timestamp;
ties keep the newer token. The timestamps are a replace-style per-token buffer ``raas`` (the prompt
holds -1); each row stamps with its own decode step, and holes (``StepSignals.slots_valid``) never
count as generated tokens.

Assumptions (the paper works on pages of a paged cache with representative page scores; the
median rule is the EpiKV authors' implementation): token level, not pages; per layer and KV head,
the current query's attention averaged over the query heads of a group; evicts every step once over
budget. The shared recent window r = min(128, K/4) is kept too (RaaS has none; new tokens carry fresh
timestamps anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.policies.attention_common import AttentionPolicy, AttentionState, folded, stacked
from epikv.policies.base import CacheView, StepSignals
from epikv.policies.registry import register


def refresh_timestamps(
    stamps: torch.Tensor, attention: torch.Tensor, now: torch.Tensor | float, real: torch.Tensor | None = None
) -> torch.Tensor:
    """RaaS's refresh: generated slots (stamp >= 0, and ``real``: False at holes, broadcastable to
    ``stamps``) whose attention (same shape as ``stamps``, (..., L)) reaches the median over the
    generated slots get stamp ``now`` (a number, or a tensor broadcastable to ``stamps``)."""
    generated = stamps >= 0
    if real is not None:
        generated = generated & real
    median = attention.float().masked_fill(~generated, float("nan")).nanmedian(dim=-1, keepdim=True).values
    now = torch.as_tensor(now, dtype=stamps.dtype, device=stamps.device)
    return torch.where(generated & (attention >= median), now, stamps)


@register
@dataclass(frozen=True)
class RaaS(AttentionPolicy):
    """Prompt kept; generated tokens evicted least-recently-attended first (median refresh rule)."""

    name = "raas"
    summary = "RaaS: prompt kept, generated tokens evicted by last-attended timestamp (LRU)."
    source = "https://arxiv.org/abs/2502.11147"
    granularity = "layer_head"

    protect_prompt: bool = True

    def observe(self, state: Any, step: StepSignals) -> dict[str, torch.Tensor]:
        st: AttentionState = state
        rows = stacked(step.attention, self.resolved_layers())[:, :, :, -1]  # (G, B, Hq, L)
        attention = folded(rows, st.model.num_kv_heads, "mean")
        g, b, h, length = attention.shape
        q = step.valid.shape[1]
        if step.prefill:
            return {"raas": attention.new_full((g, b, h, q), -1.0)}
        old = step.buffers["raas"]
        now = st.steps.to(old.dtype)[None, :, None, None]  # each row's own decode step
        stamps = torch.nn.functional.pad(old, (0, length - old.shape[-1]))
        # This step's tokens are stamped now, wherever their slot (the last q slots if not said).
        slots = step.write_slots
        if slots is None:
            slots = torch.arange(length - q, length, device=old.device).expand(b, q)
        if slots.dim() == 3:  # (G, B, H): a slot freed in place per layer and head (rank_every)
            fresh = torch.zeros(g, b, h, length, dtype=torch.bool, device=old.device)
            fresh.scatter_(-1, slots.long().expand(g, -1, h)[..., None], True)
        else:
            fresh = torch.zeros(b, length, dtype=torch.bool, device=old.device)
            fresh[torch.arange(b, device=old.device)[:, None], slots] = True
            fresh = fresh[None, :, None, :]
        stamps = torch.where(fresh, now, stamps)
        real = step.slots_valid[None, :, None, :] if step.slots_valid is not None else None
        stamps = refresh_timestamps(stamps, attention, now, real)
        st.steps = st.steps + 1
        return {"raas": stamps}

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return view.buffers["raas"]
