"""Scheduler side without an engine: vLLM's block pool under the capped manager, over 1,000 decode steps."""

from __future__ import annotations

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec

from epikv.vllm.scheduler import EpiKVAttentionManager, EpiKVAttentionSpec, capped_spec, group_caps

B, CAP, POOL = 32, 288, 64  # K + tau = 256 + 32


def manager(cap: int) -> tuple[BlockPool, EpiKVAttentionManager]:
    pool = BlockPool(num_gpu_blocks=POOL, enable_caching=False, hash_block_size=B)
    spec = EpiKVAttentionSpec(block_size=B, num_kv_heads=3, head_size=64, dtype=torch.float32, cap_tokens=cap)
    return pool, EpiKVAttentionManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=B
    )


def grow(mgr: EpiKVAttentionManager, req: str, tokens: int) -> int:
    need = mgr.get_num_blocks_to_allocate(req, tokens, [], 0, 0, tokens)
    new = mgr.allocate_new_blocks(req, tokens, tokens)
    assert len(new) == need
    return need


def test_blocks_per_request_never_pass_the_cap_and_all_return_at_finish():
    pool, mgr = manager(CAP)
    free_at_start = pool.get_num_free_blocks()
    requests = {f"r{i}": 40 + 7 * i for i in range(5)}  # five requests of different prompt lengths
    for step in range(1000):
        for req, prompt in requests.items():
            logical = prompt + step
            grow(mgr, req, logical)
            held = len(mgr.req_to_blocks[req])
            assert held == min(cdiv(logical, B), cdiv(CAP, B)), (req, step, held)
        held_total = sum(len(mgr.req_to_blocks[r]) for r in requests)
        assert pool.get_num_free_blocks() + held_total == free_at_start
    assert held_total == 5 * cdiv(CAP, B)  # 45 of 63 usable blocks for 5 x 1,000+ logical tokens
    for req in requests:
        mgr.free(req)
    assert pool.get_num_free_blocks() == free_at_start


def test_without_a_cap_blocks_follow_the_logical_length():
    _, mgr = manager(0)
    grow(mgr, "r", 500)
    assert len(mgr.req_to_blocks["r"]) == cdiv(500, B)


def test_the_cap_survives_vllm_merging_layer_specs():
    base = FullAttentionSpec(block_size=B, num_kv_heads=3, head_size=64, dtype=torch.float32)
    specs = [capped_spec(base, CAP) for _ in range(3)]
    merged = type(specs[0]).merge(specs)
    assert isinstance(merged, EpiKVAttentionSpec) and merged.cap_tokens == CAP
    assert group_caps([merged]) == [CAP]
    assert capped_spec(base, None).cap_tokens == 0
