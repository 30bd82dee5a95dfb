"""Per-token buffers under ``rank_every`` (issue 56): a token written into a slot freed in place gets
its own values there, and every other slot keeps its own (the policy sees the buffers whole)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.integration import model_info
from epikv.policies.base import CacheView, ModelInfo, Policy, StepSignals
from epikv.policies.raas import RaaS
from epikv.spec import CacheSpec
from tests.helpers.engine import prompts


@dataclass(frozen=True)
class Echo(Policy):
    """Stores each token's position in a replace-style buffer (every slot returned, the old values
    carried over) and scores by it: the buffer must equal the cache's positions at every slot."""

    name = "echo"
    granularity = "layer_head"

    def observe(self, state: Any, step: StepSignals) -> dict[str, torch.Tensor]:
        valid = step.slots_valid
        assert valid is not None and step.write_slots is not None
        if step.prefill:  # the prompt's positions, appended
            return {"echo": step.positions.float()[None, :, None, :].expand(4, -1, 2, -1)}
        old = step.buffers["echo"]
        out = torch.nn.functional.pad(old, (0, valid.shape[1] - old.shape[-1]))
        slots = step.write_slots  # (B, 1), or (G, B, H) when written into a freed slot
        index = (slots[None, :, None, :] if slots.dim() == 2 else slots[..., None]).long()
        index = index.expand(out.shape[0], -1, out.shape[2], 1)
        pos = step.positions[:, -1].float()[None, :, None, None].expand_as(index)
        return {"echo": out.scatter(-1, index, pos)}

    def score(self, state: Any, view: CacheView) -> torch.Tensor:
        return -(view.buffers["echo"] * 7 % 5)  # a ranking that is neither recency nor age


@pytest.mark.parametrize("rho", [None, 6])
def test_a_replace_buffer_follows_its_tokens(tiny_llama, rho):
    spec = CacheSpec.build(model_info(tiny_llama), Echo(), 20, interval=1, rank_every=rho)
    engine = Engine(tiny_llama, spec)
    for p in prompts(2):
        engine.submit(Request(p, 40))
    with engine:
        while engine.has_work():
            engine.step()
            cache = engine.cache
            if cache.batch_size:
                positions = cache.arena.positions[:, : cache.batch_size, :, : cache.width].float()
                echo = cache.buffers["echo"]
                held = positions >= 0
                assert torch.equal(echo[held], positions[held])


def test_raas_stamps_the_slot_each_head_wrote():
    """Head 0 wrote its token at slot 1, head 1 at slot 3 (each freed its own): only there is it new."""
    info = ModelInfo("hand", num_layers=1, num_heads=2, num_kv_heads=2, head_dim=2, hidden_size=4)
    policy = RaaS().resolve(info)
    state = policy.init_state(1, info, torch.device("cpu"))
    old = torch.tensor([[-1.0, 0.0, 1.0, 2.0], [-1.0, 1.0, 2.0, 0.0]])[None, None]  # freed slots hold 0
    step = StepSignals({}, torch.ones(1, 1, dtype=torch.bool), torch.tensor([[9]]), False)
    step.buffers, step.slots_valid = {"raas": old}, torch.ones(1, 4, dtype=torch.bool)
    step.write_slots = torch.tensor([[[1, 3]]])  # (G, B, H)
    # generated slots at or above their head's lower median attention are refreshed to now (0)
    step.attention = {0: torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.05, 0.15, 0.3]])[None, :, None]}
    stamps = policy.observe(state, step)["raas"]
    assert stamps[0, 0].tolist() == [[-1.0, 0.0, 0.0, 2.0], [-1.0, 1.0, 0.0, 0.0]]
