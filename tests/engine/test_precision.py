"""What batch = alone means in each precision, the default one included (``--dtype auto``: bfloat16
where the CPU or GPU has bf16 units, else float32).

In any precision the prompt is prefilled alone, so a request's first token is exactly its solo one,
and its later logits are its solo logits up to rounding (batched matmuls and attention block
differently by batch shape): within ROUNDING x the dtype's epsilon of the largest logit. In float32
that leaves the greedy tokens equal (``test_engine.py`` asserts them for every policy); in bfloat16
the epsilon is 65,536 times coarser and a greedy choice can flip where the two best logits are that
close, after which the texts part. README and docs/serving.md say the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.models import resolve_dtype
from tests.helpers.models import policy_params

DEFAULT = resolve_dtype("auto")[0]
ROUNDING = 8  # measured here: ~4 eps in float32, ~1 in bfloat16 (the embedded SmolLM2: ~8 and ~3)


class Logits:
    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, index: int, logits: torch.Tensor, evicted: bool) -> None:
        self.rows.append(logits.float().clone())


def forced(model, spec, prompts: list[list[int]], tokens: list[list[int]]) -> list[list[torch.Tensor]]:
    """Every step's logits of each request fed ``tokens`` (teacher forcing), all in one batch."""
    requests = [
        Request(p, len(t), forced=t, on_logits=Logits()) for p, t in zip(prompts, tokens, strict=True)
    ]
    Engine(model, spec).run(requests)
    return [r.on_logits.rows for r in requests]


@pytest.mark.parametrize("dtype", sorted({torch.float32, DEFAULT}, key=str), ids=str)
def test_a_batched_request_is_its_solo_run_up_to_rounding(tiny_llama, dtype):
    model = copy.deepcopy(tiny_llama).to(dtype)
    spec = build_spec(model, "epikv", 32, interval=4, params=policy_params("epikv"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (12, 5, 20, 9)]
    tokens = [Engine(model, spec).run([Request(p, 40)])[0].token_ids for p in prompts]
    batch = forced(model, spec, prompts, tokens)
    for prompt, own, together in zip(prompts, tokens, batch, strict=True):
        (solo,) = forced(model, spec, [prompt], [own])
        assert torch.equal(solo[0], together[0])  # the prefill runs alone: the first token is exact
        scale = max(float(row.abs().max()) for row in solo)
        worst = max(float((a - b).abs().max()) for a, b in zip(solo, together, strict=True))
        assert worst <= ROUNDING * torch.finfo(dtype).eps * scale, (dtype, worst, scale)
