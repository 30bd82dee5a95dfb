"""A decode step's compaction that raises for one row fails that row alone (epikv's own environment, no
vLLM): the worker step runs on plain step batches over a synthetic paged pool, each token's keys and
values drawn from its request and position, and a fault is injected into one row's scoring, into
only the batched call, into one row's move, or into a whole second budget group. Every other row
ends holding exactly what it holds in the same run without the fault: the same true positions, keys
and values, counters and trace lines."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from epikv.policies.base import ModelInfo
from epikv.policies.registry import policy_class
from epikv.vllm.compaction import HeadShards, SlotStore
from epikv.vllm.config import BUDGET_ARG, EpiKVSettings
from epikv.vllm.paged import PagedKV, PageLayout
from epikv.vllm.step import EpiKVWorkerState, NewRequest, StepBatch

MODEL = ModelInfo("m", 2, 4, 2, 16, 64)
B, K, STEPS = 4, 16, 20  # every request passes K and then compacts at every step
PROMPTS = {"a": 5, "b": 6, "c": 7, "d": 9}  # distinct lengths: a fault finds its row by prompt length
BLOCKS_PER_ROW = 8  # 32 slots >= K + tau


def kv(request: str, position: int) -> torch.Tensor:
    """(layers, H, 2D) keys and values of a request's token at a true position, the same in every run."""
    seed = 1000 * list(PROMPTS).index(request) + position
    h, d = MODEL.num_kv_heads, MODEL.head_dim
    return torch.randn(MODEL.num_layers, h, 2 * d, generator=torch.Generator().manual_seed(seed))


def run(
    policy: str, trace: Path, budgets: dict[str, int] | None = None, shards: HeadShards | None = None
) -> dict[str, Any]:
    """Prefill every request, then STEPS decode steps; what each request holds at the end, by true
    position (keys and values), its last counters, its fault line, and its trace lines. With
    ``shards`` (tensor parallelism) the pool holds heads ``shards.lo..hi-1`` only."""
    settings = EpiKVSettings(policy, K, trace=str(trace))
    state = EpiKVWorkerState(settings, settings.spec(MODEL), MODEL)
    ids = list(PROMPTS)
    lo, hi = (0, MODEL.num_kv_heads) if shards is None else (shards.lo, shards.hi)
    h, d = hi - lo, MODEL.head_dim
    pages = torch.zeros(MODEL.num_layers, len(ids) * BLOCKS_PER_ROW, h, B, 2 * d)
    half = torch.arange(B)[:, None] * d + torch.arange(d)
    paged = PagedKV(list(pages), PageLayout(half, B * d + half))  # row-major keys, then values
    state.store, state.block_size = SlotStore(paged, state.spec, MODEL, pages.shape[1] * B), B
    state.store.shards = shards
    blocks = {r: list(range(i * BLOCKS_PER_ROW, (i + 1) * BLOCKS_PER_ROW)) for i, r in enumerate(ids)}
    extra = {r: {BUDGET_ARG: k} for r, k in (budgets or {}).items()}
    state.after_update([NewRequest(r, p, 0, STEPS + 1, extra.get(r)) for r, p in PROMPTS.items()])
    computed = dict.fromkeys(ids, 0)
    report, faults = {}, state.take()[1]
    assert faults == {}
    for _ in range(STEPS + 1):
        live = [r for r in ids if r not in faults]
        if not live:
            break
        scheduled = np.array([PROMPTS[r] if computed[r] == 0 else 1 for r in live])
        starts = np.concatenate([[0], np.cumsum(scheduled)])
        positions = torch.cat(
            [torch.arange(computed[r], computed[r] + int(n)) for r, n in zip(live, scheduled, strict=True)]
        )
        batch = StepBatch(
            live, np.array([computed[r] for r in live]), np.array([PROMPTS[r] for r in live]), scheduled,
            starts, np.full(len(live), BLOCKS_PER_ROW * B), positions, blocks=lambda r: blocks[r],
        )  # fmt: skip
        dropped, bad = state.physical(batch)
        assert not bad.any()
        slots = []
        for i, r in enumerate(live):  # the runner's physical slots: logical minus evicted
            for pos in range(computed[r], computed[r] + int(scheduled[i])):
                p = pos - int(dropped[i])
                slot = blocks[r][p // B] * B + p % B
                pages[:, slot // B, :, slot % B] = kv(r, pos)[:, lo:hi]
                slots.append(slot)
        batch.slots = torch.tensor(slots)
        state.after_forward(batch, None)
        step_report, step_faults = state.take()
        report.update(step_report)
        faults.update(step_faults)
        for i, r in enumerate(live):
            computed[r] += int(scheduled[i])
    held = {}
    for r in ids:
        if r in faults:
            continue
        n = computed[r] - state.requests.dropped[r]  # physical slots 0..n-1 hold the request's tokens
        slots = torch.tensor([blocks[r][p // B] * B + p % B for p in range(n)])
        held[r] = (state.store.positions[:, :, slots], [paged.keys(i, slots.expand(h, -1)) for i in range(2)])
    lines = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    return {"held": held, "report": report, "faults": faults, "trace": lines}


def held_equal(x: tuple, y: tuple) -> bool:
    """Same true positions in the same slots and the same keys there (so the same tokens held)."""
    return torch.equal(x[0], y[0]) and all(torch.equal(a, b) for a, b in zip(x[1], y[1], strict=True))


def same_for(got: dict[str, Any], ref: dict[str, Any], requests: list[str]) -> None:
    for r in requests:
        assert held_equal(got["held"][r], ref["held"][r]), r
        assert got["report"][r] == ref["report"][r], r
        lines = [[x for x in run["trace"] if x["request"] == r] for run in (got, ref)]
        assert lines[0] == lines[1] and lines[0], r  # the same compactions, and some


def failing_score(policy: str, monkeypatch, when: Callable[[Any], bool]) -> list[list[int]]:
    """Make the policy's scoring raise for views ``when`` picks; returns each call's rows (their
    prompt lengths), its budget and its step (tokens seen past the prompt, the same for every row)."""
    cls, calls = policy_class(policy), []
    score = cls.score

    def broken(self, state, view):
        calls.append([view.prompt_len.tolist(), view.budget, int(view.seen[0] - view.prompt_len[0])])
        if when(view):
            raise RuntimeError("a fault for the test")
        return score(self, state, view)

    monkeypatch.setattr(cls, "score", broken)
    return calls


@pytest.fixture(params=["streaming", "keydiff"])
def policy(request) -> str:
    return request.param


def test_one_rows_scoring_fault_fails_that_row_alone(policy, tmp_path, monkeypatch):
    ref = run(policy, tmp_path / "ref.jsonl")
    assert ref["faults"] == {} and all(ref["report"][r][1] > 0 for r in PROMPTS)  # every row evicts
    calls = failing_score(policy, monkeypatch, lambda view: PROMPTS["b"] in view.prompt_len.tolist())
    got = run(policy, tmp_path / "got.jsonl")
    assert any(len(c) > 1 and PROMPTS["b"] in c for c, _, _ in calls)  # b was scored with others
    assert list(got["faults"]) == ["b"]
    assert got["faults"]["b"] == "compaction failed: RuntimeError: a fault for the test"
    same_for(got, ref, ["a", "c", "d"])


def test_a_fault_of_the_batched_call_alone_fails_no_row(policy, tmp_path, monkeypatch):
    ref = run(policy, tmp_path / "ref.jsonl")
    calls = failing_score(policy, monkeypatch, lambda view: len(view.prompt_len) > 1)
    got = run(policy, tmp_path / "got.jsonl")
    assert any(len(c) > 1 for c, _, _ in calls) and got["faults"] == {}
    same_for(got, ref, list(PROMPTS))


def test_a_move_that_raises_for_one_row_fails_that_row_alone(policy, tmp_path, monkeypatch):
    """The move raises part-way (after the first layer) whenever it carries b's slots: the others'
    parts are done again alone, and b fails."""
    ref = run(policy, tmp_path / "ref.jsonl")
    move, b_slots = PagedKV.move, set(range(BLOCKS_PER_ROW * B, 2 * BLOCKS_PER_ROW * B))  # b's blocks

    def broken(self, src, dst, layers, heads):
        if b_slots & set(src.tolist()):
            first = None if layers is None else layers == 0
            if first is None:
                pages = self.pages
                self.pages = pages[:1]  # half done: the first layer moved, then the fault
                self.num_layers = 1
                try:
                    move(self, src, dst, None, heads)
                finally:
                    self.pages, self.num_layers = pages, len(pages)
            else:
                move(self, src[first], dst[first], layers[first], None if heads is None else heads[first])
            raise MemoryError("a fault for the test")
        move(self, src, dst, layers, heads)

    monkeypatch.setattr(PagedKV, "move", broken)
    got = run(policy, tmp_path / "got.jsonl")
    assert list(got["faults"]) == ["b"]
    assert got["faults"]["b"] == "compaction failed: MemoryError: a fault for the test"
    same_for(got, ref, ["a", "c", "d"])


def test_a_failing_second_budget_group_does_not_fail_the_first(policy, tmp_path, monkeypatch):
    budgets = {"a": K - 2, "c": K - 2, "b": K, "d": K}  # groups by K: (a, c) first, then (b, d)
    ref = run(policy, tmp_path / "ref.jsonl", budgets)
    calls = failing_score(policy, monkeypatch, lambda view: view.budget == K)
    got = run(policy, tmp_path / "got.jsonl", budgets)
    # in one step the first group (a, c) was compacted in one call, then the second group raised
    first = {step for rows, k, step in calls if k == K - 2 and rows == [PROMPTS["a"], PROMPTS["c"]]}
    assert first & {step for _, k, step in calls if k == K}
    assert sorted(got["faults"]) == ["b", "d"]
    same_for(got, ref, ["a", "c"])


def test_an_observe_that_raises_for_one_row_fails_that_row_alone(policy, tmp_path, monkeypatch):
    """Observing a decode step raises whenever b is among the rows: the step's rows are observed
    again one at a time, b fails, and the others hold what they hold without the fault."""
    from epikv.vllm.requests import Requests

    ref = run(policy, tmp_path / "ref.jsonl")
    batch, observe, cls = Requests.batch, [], policy_class(policy)
    original = cls.observe

    def watched(self, req_ids):  # the rows the next observe sees
        observe.append(list(req_ids))
        return batch(self, req_ids)

    def broken(self, state, signals):
        if not signals.prefill and "b" in observe[-1]:
            raise RuntimeError("a fault for the test")
        return original(self, state, signals)

    monkeypatch.setattr(Requests, "batch", watched)
    monkeypatch.setattr(cls, "observe", broken)
    got = run(policy, tmp_path / "got.jsonl")
    assert ["a", "b", "c", "d"] in observe and ["b"] in observe  # batched, then alone
    assert got["faults"] == {"b": "decode step failed: RuntimeError: a fault for the test"}
    same_for(got, ref, ["a", "c", "d"])
