"""Scheduler side without an engine: vLLM's block pool under the capped manager, over 1,000 decode steps."""

from __future__ import annotations

import pytest
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec

from epikv.errors import BudgetOutOfRange
from epikv.policies.base import ModelInfo
from epikv.vllm.config import BUDGET_ARG, EpiKVSettings, RequestPlan, plan_request
from epikv.vllm.scheduler import EpiKVAttentionManager, EpiKVAttentionSpec, capped_spec

B, POOL = 32, 64
MODEL = ModelInfo("m", 30, 9, 3, 64, 576)


def manager(plans: dict[str, RequestPlan]) -> tuple[BlockPool, EpiKVAttentionManager]:
    pool = BlockPool(num_gpu_blocks=POOL, enable_caching=False, hash_block_size=B)
    spec = EpiKVAttentionSpec(block_size=B, num_kv_heads=3, head_size=64, dtype=torch.float32, cap_tokens=288)
    mgr = EpiKVAttentionManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=B
    )
    mgr.plans = plans
    return pool, mgr


def grow(mgr: EpiKVAttentionManager, req: str, tokens: int) -> int:
    need = mgr.get_num_blocks_to_allocate(req, tokens, [], 0, 0, tokens)
    new = mgr.allocate_new_blocks(req, tokens, tokens)
    assert len(new) == need
    return need


def test_a_request_gets_its_whole_reservation_at_once_and_never_more():
    spec = EpiKVSettings("streaming", 256, 32).spec(MODEL)
    lengths = {"r0": (40, 2000), "r1": (47, 100), "r2": (300, 2000), "r3": (54, 10)}  # prompt, max_tokens
    plans = {r: plan_request(spec, p, n, None) for r, (p, n) in lengths.items()}
    # hand-computed: K + tau = 288; a prompt of 300 > K is held whole, then compacted to 256
    assert [plans[r].reserve for r in lengths] == [288, 147, 300, 64]
    pool, mgr = manager(plans)
    free_at_start = pool.get_num_free_blocks()
    for step in range(1000):
        for req, (prompt, _) in lengths.items():
            allocated = grow(mgr, req, prompt + step)
            assert allocated == (cdiv(plans[req].reserve, B) if step == 0 else 0), (req, step)
            assert len(mgr.req_to_blocks[req]) == cdiv(plans[req].reserve, B)
        held_total = sum(len(mgr.req_to_blocks[r]) for r in lengths)
        assert pool.get_num_free_blocks() + held_total == free_at_start
    for req in lengths:
        mgr.free(req)
    assert pool.get_num_free_blocks() == free_at_start


def test_without_a_plan_blocks_follow_the_logical_length():
    _, mgr = manager({})
    grow(mgr, "r", 500)
    assert len(mgr.req_to_blocks["r"]) == cdiv(500, B)
    _, mgr = manager({"r": RequestPlan(None, None, None)})  # ``full``: nothing reserved
    grow(mgr, "r", 70)
    assert len(mgr.req_to_blocks["r"]) == cdiv(70, B)


def test_the_cap_survives_vllm_merging_layer_specs():
    base = FullAttentionSpec(block_size=B, num_kv_heads=3, head_size=64, dtype=torch.float32)
    specs = [capped_spec(base, 288) for _ in range(3)]
    merged = type(specs[0]).merge(specs)
    assert isinstance(merged, EpiKVAttentionSpec) and merged.cap_tokens == 288
    assert capped_spec(base, None).cap_tokens == 0


def test_the_request_rule_is_the_run_specs():
    epikv = EpiKVSettings("epikv", 256, params={"band_a": 10, "band_b": 20}).spec(MODEL)
    lag = EpiKVSettings("streaming", 64, 16, {"first_compaction": "after_interval"}).spec(MODEL)
    # after the prefill: max(P, K + tau); after an interval: max(P, K) + tau (CacheSpec.cap_tokens)
    assert plan_request(epikv, 100, None, None) == RequestPlan(256, 384, 384)
    assert plan_request(lag, 70, None, None) == RequestPlan(64, 86, 86)
    assert plan_request(lag, 80, 3, None) == RequestPlan(64, 96, 83)
    assert plan_request(epikv, 50, None, {BUDGET_ARG: "128"}) == RequestPlan(128, 256, 256)
    with pytest.raises(BudgetOutOfRange, match=r"epikv_budget=512.*1\.\.256"):
        plan_request(epikv, 100, None, {BUDGET_ARG: 512})
    with pytest.raises(BudgetOutOfRange, match="epikv_budget='lots'"):
        plan_request(epikv, 100, None, {BUDGET_ARG: "lots"})
    # Seg-Q protects the prompt: 300 + 128 cannot fit K 256, so it runs at the smallest K that holds
    # the prompt and its recent window, 399 (300 + 399 // 4; 398 cannot), keeping its prompt
    assert epikv.min_budget(300) == 399
    assert plan_request(epikv, 300, None, None) == RequestPlan(399, 399 + 128, 399 + 128)
    assert plan_request(epikv, 300, 50, {BUDGET_ARG: 64}) == RequestPlan(399, 527, 350)
