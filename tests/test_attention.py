"""Attention rows for attention-based policies: recomputed beside SDPA == the eager kernel's weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import epikv
from epikv.integration import attention_implementation, kernels
from epikv.integration.arch import decoder_layers
from epikv.integration.attention import attention_rows
from epikv.integration.compat import cache_kwargs
from epikv.policies.base import CacheView, Needs, Policy, StepSignals, global_scores

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11]])


@dataclass(frozen=True)
class AttentionRecorder(Policy):
    name: ClassVar[str] = "attention-recorder"
    seen: ClassVar[list] = []

    def needs(self) -> Needs:
        return Needs(attention_layers=(1, 3), attention_queries=2)  # global in every tiny model

    def observe(self, state: Any, step: StepSignals) -> dict[str, torch.Tensor]:
        AttentionRecorder.seen.append(
            (
                {k: v.clone() for k, v in step.attention.items()},
                {k: v.clone() for k, v in step.attention_colsum.items()},
            )
        )
        return {}

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return global_scores(torch.zeros(view.valid.shape))


def record(model, mode: str) -> list:
    AttentionRecorder.seen.clear()
    before = attention_implementation(model)
    with epikv.attach(model, AttentionRecorder(recent=4), budget=14, attention=mode) as cache:
        # recompute keeps the fused kernel: SDPA, with one-token steps on packed query groups
        fused = kernels.NAME if before == "sdpa" else before  # gpt-oss runs its own eager attention
        assert attention_implementation(model) == ("eager" if mode == "eager" else fused)
        logits = model(input_ids=PROMPT, **cache_kwargs(model, cache), use_cache=True).logits
        for _ in range(12):
            logits = model(
                input_ids=logits[:, -1].argmax(-1, keepdim=True),
                **cache_kwargs(model, cache),
                use_cache=True,
            ).logits
    assert attention_implementation(model) == before
    return list(AttentionRecorder.seen)


def test_recompute_equals_eager(arch_model):
    fast, eager = record(arch_model, "recompute"), record(arch_model, "eager")
    assert len(fast) == len(eager) == 13
    first, last = 1, 3
    for (rows_f, sums_f), (rows_e, sums_e) in zip(fast, eager, strict=True):
        for layer in (first, last):
            torch.testing.assert_close(rows_f[layer], rows_e[layer], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(sums_f[layer], sums_e[layer], rtol=1e-4, atol=1e-5)
    prefill_rows, prefill_sums = fast[0]
    assert prefill_rows[first].shape == (1, 4, 2, 10)
    # every query row is a distribution: column sums over 10 prompt queries total 10 per head (less
    # where learned sinks take their share)
    total = prefill_sums[first].sum(-1)
    sinks = getattr(decoder_layers(arch_model)[first].self_attn, "sinks", None)
    if sinks is None:
        torch.testing.assert_close(total, torch.full((1, 4), 10.0))
    else:
        assert bool((total < 10.0).all()) and bool((total > 0).all())


def test_attention_rows_chunking_and_masks():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 300, 4), torch.randn(1, 1, 310, 4)
    valid = torch.ones(1, 310, dtype=torch.bool)
    valid[0, 3] = False
    rows, colsum = attention_rows(q, k, valid, last=3)
    logits = torch.einsum("bhqd,bhld->bhql", q, k.expand(1, 2, -1, -1)) / 2.0
    slot = torch.arange(310)
    visible = (slot[None, :] <= (10 + torch.arange(300))[:, None]) & valid[0][None, :]
    full = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    torch.testing.assert_close(rows, full[:, :, -3:])
    torch.testing.assert_close(colsum, full.sum(dim=2), rtol=1e-4, atol=1e-4)
    assert float(colsum[0, :, 3].abs().max()) == 0.0
