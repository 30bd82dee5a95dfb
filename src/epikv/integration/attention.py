"""Attention rows for the policies that need them (H2O, TOVA, SnapKV, R-KV, RaaS, ThinKV...).

Two sources, chosen per attach and recorded in the run config:

* ``recompute`` (default): the model keeps its fused kernel (SDPA / FlashAttention); a pre-hook on
  each needed attention module reads its normed input and RoPE tables, recomputes the new tokens'
  queries, and after the step the rows softmax(q.K^T / sqrt(d)) over the cached keys are computed
  beside the kernel, in query chunks so memory stays bounded.
* ``eager``: the model is switched to eager attention for the duration of the attach and the
  weights its attention modules return are read (the paper's set-up for attention baselines).

Policies receive, per layer, the rows of the last ``rows`` new queries (B, Hq, w, L) and the sum of
all new queries' rows (B, Hq, L), which is what accumulation (H2O) needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epikv.integration.arch import ArchFacts, attention_queries, decoder_layers
from epikv.scoring import gqa_logits
from epikv.spec import ATTENTION_MODES

CHUNK = 256  # query rows scored at once when recomputing (bounds memory to CHUNK x L per head)


class AttentionCapture:
    """Collects attention rows of the new tokens at ``layers`` for one attached cache."""

    def __init__(
        self, model: nn.Module, spec: ArchFacts, layers: tuple[int, ...], rows: int, mode: str
    ) -> None:
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
        self.model, self.spec, self.layers, self.rows, self.mode = model, spec, layers, max(rows, 1), mode
        self._queries: dict[int, torch.Tensor] = {}
        self._weights: dict[int, torch.Tensor] = {}
        self._sinks: dict[int, torch.Tensor] = {}
        self._previous_impl: str | None = None
        self.active = False

    def install(self) -> list[Any]:
        handles = []
        for index in self.layers:
            attn = decoder_layers(self.model)[index].self_attn
            if self.spec.sinks is not None:
                self._sinks[index] = getattr(attn, self.spec.sinks).detach()
            if self.mode == "recompute":
                handles.append(attn.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            else:
                handles.append(attn.register_forward_hook(self._post(index)))
        if self.mode == "eager":
            self._previous_impl = self.model.config._attn_implementation
            self.model.set_attn_implementation("eager")
        return handles

    def restore(self) -> None:
        if self._previous_impl is not None:
            self.model.set_attn_implementation(self._previous_impl)
            self._previous_impl = None

    def _pre(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if not self.active:
                return
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            with torch.no_grad():
                self._queries[index] = attention_queries(module, self.spec, hidden, cos, sin)

        return hook

    def _post(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.active and isinstance(output, tuple) and output[1] is not None:
                self._weights[index] = output[1].detach()

        return hook

    def collect(
        self, keys: dict[int, torch.Tensor], valid: torch.Tensor, new_valid: torch.Tensor
    ) -> tuple[dict, dict]:
        """Rows of the last ``rows`` new queries and the column sums over all new queries, per layer.

        keys: layer -> (B, H, L, D) cached keys after this step's update; valid: (B, L); new_valid:
        (B, q), False for left-padding queries, whose rows are zeroed (eager attention gives a fully
        masked row a uniform distribution, recomputation gives zeros: both become zeros)."""
        rows, colsum = {}, {}
        query_mask = new_valid[:, None, :, None].float()
        for index in self.layers:
            if self.mode == "eager":
                weights = self._weights.pop(index).float() * query_mask
                rows[index] = weights[:, :, -self.rows :]
                colsum[index] = weights.sum(dim=2)
            else:
                rows[index], colsum[index] = attention_rows(
                    self._queries.pop(index), keys[index], valid, self.rows, self._sinks.get(index)
                )
        return rows, colsum


def attention_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    last: int,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q.K^T / sqrt(D)) of new queries (B, Hq, q, D) against all cached keys (B, H, L, D),
    where the new tokens are the last q slots (causal among them) and ``valid`` (B, L) masks holes;
    ``sinks`` (Hq,) are learned logits joining each softmax (gpt-oss), whose share no key receives.
    Returns the last ``last`` rows (B, Hq, min(q, last), L) and the sum of all rows (B, Hq, L)."""
    b, hq, q, _ = queries.shape
    length = keys.shape[2]
    keys = keys.float()  # once, not per chunk
    slots = torch.arange(length, device=keys.device)
    colsum = torch.zeros(b, hq, length, device=keys.device)
    tail = []
    for lo in range(0, q, CHUNK):  # one chunk in decoding; bounded memory for long prefills
        hi = min(lo + CHUNK, q)
        logits = gqa_logits(queries[:, :, lo:hi], keys)
        query_slot = (length - q + torch.arange(lo, hi, device=keys.device))[:, None]
        visible = (slots[None, :] <= query_slot)[None, None] & valid[:, None, None, :]
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, hi - lo, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        colsum += probs.sum(dim=2)
        if hi > q - last:
            tail.append(probs[:, :, max(lo, q - last) - lo :])
    return torch.cat(tail, dim=2), colsum
