"""A policy replaces its state's fields and never writes into them, so a snapshot of the state's
structure (:func:`snapshot_rows`) is what the state was before a call that raised: the vLLM plugin
restores it before observing a failed decode step's rows again one at a time."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import epikv
from epikv.integration.compat import cache_kwargs
from epikv.policies import policy_class, policy_names
from epikv.policies.rows import RowState, snapshot_rows
from tests.helpers.models import policy_params

PROMPT = torch.tensor(
    [[5, 17, 3, 44, 8, 9, 21, 60, 2, 11, 13, 70], [7, 1, 9, 33, 4, 12, 50, 6, 18, 2, 40, 3]]
)


def same(x: Any, y: Any) -> bool:
    """Equal structure and equal tensors (a deep comparison)."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, RowState):
        return type(x) is type(y) and all(same(v, getattr(y, k)) for k, v in vars(x).items())
    if isinstance(x, list):
        return isinstance(y, list) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, torch.Generator):  # a seeded row's generator: the same draws to come
        return isinstance(y, torch.Generator) and torch.equal(x.get_state(), y.get_state())
    return x == y


@pytest.mark.parametrize("name", [n for n in policy_names() if policy_class(n).evicts])
def test_observe_leaves_a_snapshot_of_the_state_as_it_was(tiny_llama, name, monkeypatch):
    cls, seen = policy_class(name), []
    observe = cls.observe

    def watched(self, state, step):
        before, deep = snapshot_rows(state), copy.deepcopy(state)
        out = observe(self, state, step)
        seen.append(state is not None)
        assert same(before, deep), "observe wrote into a state field in place"
        return out

    monkeypatch.setattr(cls, "observe", watched)
    with epikv.attach(tiny_llama, name, budget=16, interval=2, **policy_params(name)) as cache:
        tiny_llama.generate(
            PROMPT, max_new_tokens=12, min_new_tokens=12, do_sample=False, **cache_kwargs(tiny_llama, cache)
        )
    assert seen and cache.compactions > 0


def test_a_snapshot_shares_tensors_and_not_structure():
    from epikv.policies.thinkv import ThoughtStats

    stats = ThoughtStats(torch.zeros(2), torch.ones(2, 3), torch.ones(2, 3), [4, 5], [[1], [2]])
    saved = snapshot_rows(stats)
    stats.sums, stats.steps = stats.sums + 1, [s + 1 for s in stats.steps]
    stats.levels[0] = [9]
    assert saved.sums is not stats.sums and torch.equal(saved.sums, torch.ones(2, 3))
    assert saved.steps == [4, 5] and saved.levels == [[1], [2]]
    assert saved.prompt_len is stats.prompt_len  # no tensor is copied
