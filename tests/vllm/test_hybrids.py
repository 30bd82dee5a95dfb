"""A hybrid (sliding-window layers beside global ones) under the plugin: only the global layers' KV
cache group is capped and compacted, vLLM keeps the sliding group with its own manager, lengths and
kernels, and admission leaves the sliding group's recycled blocks room, so a running evicting request
is never preempted for one (which would fail it). Tokens and kept sets against epikv's engine, per
hybrid type, are in ``test_archs.py``."""

from __future__ import annotations

import pytest
import torch

import epikv.vllm
from epikv.vllm.scheduler import EpiKVAttentionManager
from tests.vllm.engines import close, generate, make_llm, worker_state

BLOCK = 32


@pytest.fixture(scope="module")
def gemma3(tiny):
    """epikv's tiny Gemma 3: a sliding window of 6 in layers 0 and 2, global layers 1 and 3."""
    return tiny["gemma3_text"]


def _prompts(lengths):
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in lengths]


def test_compaction_moves_only_global_blocks_and_sliding_lengths_stay_logical(gemma3):
    llm = make_llm(gemma3, max_model_len=512, **epikv.vllm.engine_kwargs("streaming", 24))
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    state = worker_state(llm)
    group = runner.epikv_group
    groups = runner.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec", "EpiKVAttentionSpec"]
    assert group == 1 and state.store.paged.num_layers == 2  # layers 1 and 3 only
    moves, lengths = [], []
    move = state.store.paged.move

    def watched(src, dst, layers, heads):  # where each compaction writes, against every request's blocks
        blocks = {r: [list(ids) for ids in req.block_ids] for r, req in runner.requests.items()}
        moves.append((src // BLOCK, dst // BLOCK, blocks))
        move(src, dst, layers, heads)

    state.store.paged.move = watched
    builders = [b for attn in runner.attn_groups[0] for b in attn.metadata_builders]
    for builder in builders:  # the sliding group's builder: the lengths it is handed
        build = builder.build
        builder.build = lambda prefix, common, *a, _b=build, **k: (
            lengths.append(common.seq_lens.tolist()),
            _b(prefix, common, *a, **k),
        )[1]
    prompts = _prompts((9, 30, 40))
    out = generate(llm, prompts, 60)
    close(llm)
    assert moves, "no compaction moved a token"
    for src, dst, blocks in moves:
        owned = {b for ids in blocks.values() for b in ids[group]}
        sliding = {b for ids in blocks.values() for b in ids[0]} - {0}
        touched = set(src.tolist()) | set(dst.tolist())
        assert touched <= owned and not touched & sliding
    # the sliding group saw logical lengths: one row at 40 + 59 tokens, past any physical length
    assert max(max(row) for row in lengths) == 40 + 59
    peaks = [o.kv_transfer_params["epikv"]["peak_cache_tokens"] for o in out]
    assert peaks == [25, 30, 40]


def _tight_run(folder, headroom: bool):
    """8 requests of 9 prompt tokens and 100 new ones on a pool of 10 blocks: each holds one global
    block (K + 1 = 25 tokens) and one or two sliding ones (two while its window straddles a block)."""
    pool = {"num_gpu_blocks_override": 10, "max_num_batched_tokens": 64}  # a sliding window: 4 blocks at most
    # 9 usable blocks: one request of max_model_len (5 global blocks and 4 sliding ones), as vLLM checks
    llm = make_llm(folder, max_model_len=160, **pool, **epikv.vllm.engine_kwargs("streaming", 24))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    if not headroom:
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            if isinstance(manager, EpiKVAttentionManager):
                manager.headroom = None
    out = generate(llm, _prompts([9] * 8), 100)
    close(llm)
    return [o.outputs[0].finish_reason for o in out], [len(o.outputs[0].token_ids) for o in out]


def test_admission_leaves_the_sliding_windows_room_so_no_request_is_preempted(gemma3):
    reasons, lengths = _tight_run(gemma3, headroom=True)
    assert reasons == ["length"] * 8 and lengths == [100] * 8
    reasons, _ = _tight_run(gemma3, headroom=False)  # the control: without it, the pool runs dry
    assert "error" in reasons


def test_a_shared_prefix_hits_vllms_cache_with_the_same_tokens(gemma3):
    """Prefix caching on a hybrid (both groups' blocks of a shared prompt prefix reused): a policy that
    protects the prompt gives the same tokens and counters as without the cache."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 40000, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (5, 9, 12)]
    runs = {}
    for cached in (False, True):
        llm = make_llm(
            gemma3,
            max_model_len=512,
            enable_prefix_caching=cached,
            **epikv.vllm.engine_kwargs("keydiff", 110),
        )
        outs = [generate(llm, [p], 60)[0] for p in prompts]  # one after another: later ones can hit
        close(llm)
        runs[cached] = outs
    assert [o.num_cached_tokens for o in runs[True]] == [0, 64, 64]  # two whole blocks of the prefix
    for plain, cached in zip(runs[False], runs[True], strict=True):
        assert list(cached.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
        assert cached.kv_transfer_params["epikv"] == plain.kv_transfer_params["epikv"]
        assert plain.kv_transfer_params["epikv"]["evictions"] > 0


def test_a_request_that_can_never_be_placed_is_refused_at_arrival_and_the_queue_moves_on(gemma3):
    """Near the pool (12 blocks, 11 usable): under K = 200 a 100-token prompt (chunks of at most 64)
    with 300 new tokens reserves 7 global blocks; vLLM's allocation also counts its whole prompt's
    sliding blocks (4) and epikv the shortfall at its second chunk (1): 12, so it can never be placed
    and is refused at arrival with one line, by the count allocation uses. Before, arrival counted
    11: it was admitted and then waited at the head of vLLM's queue forever, with every request
    behind it. Behind it here: one that reserves 6 global blocks (11 in all) runs to its end, and a
    small one runs after it."""
    from vllm import SamplingParams

    pool = {"num_gpu_blocks_override": 12, "max_num_batched_tokens": 64}
    # 11 usable blocks: one request of max_model_len (7 global blocks and 4 sliding ones), as vLLM checks
    llm = make_llm(gemma3, max_model_len=224, **pool, **epikv.vllm.engine_kwargs("streaming", 200))
    long, fits, small = _prompts([100, 100, 9])
    engine, done = llm.llm_engine, {}
    for rid, prompt, n in [("never", long, 300), ("fits", fits, 92), ("small", small, 10)]:
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in range(600):  # bounded: a request that never runs must fail the test, not hang it
        if not engine.has_unfinished_requests():
            break
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    close(llm)
    assert sorted(done) == ["fits", "never", "small"]
    assert done["never"].outputs[0].finish_reason == "error"
    error = done["never"].kv_transfer_params["epikv"]["error"]
    assert "201 tokens (7 blocks of 32, and 5 for its sliding windows)" in error
    assert "more than the whole KV pool (11 blocks)" in error
    assert [done[r].outputs[0].finish_reason for r in ("fits", "small")] == ["length", "length"]
    assert [len(done[r].outputs[0].token_ids) for r in ("fits", "small")] == [92, 10]
