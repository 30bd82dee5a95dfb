"""The plugin's worker step on plain step batches, without vLLM (epikv's own environment): the cap
check faults one request alone, a plan the rule refuses faults its request, and faults and counters
leave with the step's report."""

from __future__ import annotations

import numpy as np
import torch

from epikv.policies.base import ModelInfo
from epikv.vllm.config import BUDGET_ARG, EpiKVSettings
from epikv.vllm.step import EpiKVWorkerState, NewRequest, StepBatch

MODEL = ModelInfo("m", 30, 9, 3, 64, 576)


def state(policy: str = "streaming", budget: int = 48) -> EpiKVWorkerState:
    settings = EpiKVSettings(policy, budget)
    return EpiKVWorkerState(settings, settings.spec(MODEL), MODEL)


def batch(ids, computed, prompts, scheduled, room) -> StepBatch:
    scheduled = np.array(scheduled, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(scheduled)])
    return StepBatch(
        ids=list(ids),
        computed=np.array(computed, dtype=np.int64),
        prompts=np.array(prompts, dtype=np.int64),
        scheduled=scheduled,
        starts=starts,
        room=np.array(room, dtype=np.int64),
        positions=torch.arange(int(starts[-1])),
    )


def test_a_row_past_its_cap_faults_that_request_alone():
    s = state()
    s.after_update([NewRequest("a", 30, 0, 100, None), NewRequest("b", 30, 0, 100, None)])
    s.requests.dropped["a"] = 10  # a has evicted 10: it holds 60 - 10 + 1 = 51 > its cap of 49
    dropped, bad = s.physical(batch("ab", [60, 40], [30, 30], [1, 1], [64, 64]))
    assert dropped.tolist() == [10, 0] and bad.tolist() == [True, False]
    _, faults = s.take()
    assert list(faults) == ["a"] and "past its cap of 49" in faults["a"]
    assert set(s.requests.records) == {"b"} and s.take() == ({}, {})


def test_a_row_past_its_reserved_blocks_faults_too():
    s = state()
    s.after_update([NewRequest("a", 30, 0, 100, None)])
    _, bad = s.physical(batch("a", [40], [30], [1], [32]))  # 41 tokens in 32 reserved slots
    assert bad.tolist() == [True] and "32 reserved slots" in s.take()[1]["a"]


def test_a_request_the_rule_refuses_is_faulted_not_raised():
    s = state("epikv", 64)
    s.after_update(
        [
            NewRequest("big", 300, 0, 10, None),  # Seg-Q protects it: runs at 300 + 99 (item 0)
            NewRequest("budget", 20, 0, 10, {BUDGET_ARG: 1000}),
            NewRequest("embeds", None, 0, 10, None),
            NewRequest("ok", 20, 0, 10, {BUDGET_ARG: 40}),
        ]
    )
    faults = s.take()[1]
    assert sorted(faults) == ["budget", "embeds"] and "epikv_budget=1000" in faults["budget"]
    assert list(s.requests.records) == ["big", "ok"]
    assert s.requests.records["ok"].books.budgets == [40]
    assert s.requests.records["ok"].cap == 40 + 128  # after an interval: max(P, K) + tau
    assert s.requests.records["big"].books.budgets == [399] and s.requests.records["big"].cap == 399 + 128


def test_a_prefix_cache_hit_starts_the_books_holding_the_cached_prompt():
    s = state("epikv", 64)
    s.after_update([NewRequest("hit", 40, 32, 10, None)])
    books = s.requests.records["hit"].books
    assert books.held == [32] and books.seen.tolist() == [32] and books.prompt_len.tolist() == [40]


class _Store:
    def write_buffer(self, name, slots, value) -> None:
        pass


def test_a_prefill_keeps_the_last_row_not_a_view_of_the_batch():
    """The policy's state after a prompt chunk holds its last band states in storage of their own,
    not views that keep the step's whole (tokens, hidden) batch of states alive."""
    s = state("epikv", 64)
    s.after_update([NewRequest("a", 20, 0, 10, None)])
    s.store = _Store()
    aux = {a - 1: torch.randn(64, MODEL.hidden_size) for a in s.aux_layers}
    s._prefill("a", aux, torch.arange(20), torch.arange(20), 19)
    kept = s.requests.records["a"].state
    for h, layer in ((kept.prev_a, s.spec.policy.band_a), (kept.prev_b, s.spec.policy.band_b)):
        assert h.untyped_storage().nbytes() == h.numel() * h.element_size()
        torch.testing.assert_close(h, aux[layer][19:20])
