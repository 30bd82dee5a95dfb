"""The KV arena: memory is allocated once and written in place, the pool is physical, finished rows'
slots are reused, grouped-query heads are never repeated, Seg-Q's first compaction waits tau, and
rows move only through the arena (kept rows forward, other rows appended, a row view left in place)."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa

import epikv
from epikv.cache import Arena, ArenaShape
from epikv.engine import Engine, Request, SchedulerLimits
from epikv.engine.engine import fill_gaps
from epikv.integration import model_info
from epikv.integration.compat import cache_kwargs
from epikv.models.tiny import tiny_model
from tests.helpers.engine import prompts, spec_for
from tests.helpers.models import policy_params


def slot_bytes(model) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4  # fp32 keys + values


@pytest.mark.parametrize(("name", "rows"), [("streaming", 3), ("epikv-segq", 2), ("full", None)])
def test_allocated_kv_bytes_never_exceed_the_pool(tiny_llama, name, rows):
    spec = spec_for(tiny_llama, name, budget=32)
    pool = 150 if rows is None else rows * (spec.budget + spec.interval) + 7
    engine = Engine(tiny_llama, spec, SchedulerLimits(kv_pool=pool))
    lengths = [30, 45, 12, 60, 25, 40]
    for i, ids in enumerate(prompts(4) + prompts(2, seed=1)):
        engine.submit(Request(ids, lengths[i]))
    most, steps = 0, 0
    with engine:
        while engine.has_work():
            engine.step()
            steps += 1
            allocated = engine.cache.kv_bytes()
            assert allocated <= pool * slot_bytes(tiny_llama), (steps, allocated)
            most = max(most, engine.running)
    assert most >= 2  # the pool ran requests side by side, and never held more than it allows


def test_a_hybrid_models_windows_count_in_the_pool():
    """Sliding-window rings are held in the pool's slots too: allocated bytes (global arena and
    rings) never exceed pool x the bytes of one slot of the evicting layers."""
    model = tiny_model("gemma3_text")  # layers 0 and 2 slide (window 6), 1 and 3 evict
    info = model_info(model)
    assert info.window_slots == 7  # (6 + 1) slots x 2 sliding layers / 2 evicting layers
    c = model.config
    evicting_slot = 2 * len(info.cache_layers) * c.num_key_value_heads * c.head_dim * 4
    spec = spec_for(model, "streaming", budget=16)
    pool = 2 * (spec.budget + spec.interval + info.window_slots) + 3
    engine = Engine(model, spec, SchedulerLimits(kv_pool=pool))
    for i, ids in enumerate(prompts(4)):
        engine.submit(Request(ids, 20 + 5 * i))
    most, rings = 0, set()
    with engine:
        while engine.has_work():
            engine.step()
            assert engine.cache.kv_bytes() <= pool * evicting_slot
            most = max(most, engine.running)
            if engine.running:
                rings.add(engine.cache.windows.arena.keys[0].data_ptr())
                assert engine.cache.layers[0].keys.shape[2] == c.sliding_window + 1
    assert most == 2
    assert len(rings) == 1  # the rings were allocated once and written in place


def test_a_decode_step_writes_in_place(tiny_llama):
    """Between steps that need no more room the storage is the same tensor: nothing is concatenated."""
    spec = spec_for(tiny_llama, "epikv-segq", budget=32)
    engine = Engine(tiny_llama, spec)
    for ids in prompts(3):
        engine.submit(Request(ids, 40))
    pointers = set()
    with engine:
        engine.step()  # admissions may grow the arena
        for _ in range(30):
            engine.step()
            pointers.add(engine.cache.arena.keys[0].data_ptr())
    assert len(pointers) == 1
    assert engine.cache.arena.slots == spec.budget + spec.interval  # K + tau, the reservation


def test_finished_rows_are_reused_without_growing(tiny_llama):
    spec = spec_for(tiny_llama, "streaming", budget=20)
    engine = Engine(tiny_llama, spec, SchedulerLimits(max_batch=2))
    for i, ids in enumerate(prompts(4)):
        engine.submit(Request(ids, 10 + 5 * i))
    with engine:
        engine.step()
        rows = engine.cache.arena.rows
        while engine.has_work():
            engine.step()
            assert engine.cache.arena.rows == rows == 2


def test_fill_gaps_moves_only_tail_rows():
    assert fill_gaps(5, [1]) == [0, 4, 2, 3]
    assert fill_gaps(4, [3]) == [0, 1, 2]
    assert fill_gaps(4, [0, 1]) == [3, 2]
    assert fill_gaps(3, [0, 1, 2]) == []


@pytest.mark.exactness
def test_grouped_query_heads_are_never_repeated_in_decoding(tiny_llama, monkeypatch):
    """transformers packs the query groups for one-token steps (even with our hole mask): K and V are
    read once per KV head, never copied per query head."""
    assert tiny_llama.config.num_attention_heads > tiny_llama.config.num_key_value_heads
    calls = []
    original = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: calls.append(1) or original(*a))
    spec = spec_for(tiny_llama, "streaming", budget=16)
    engine = Engine(tiny_llama, spec)
    with engine:
        engine.add(Request(prompts(1)[0], 30))
        engine.add(Request(prompts(2)[1], 30))  # rows of different lengths: the hole mask is on
        calls.clear()  # prefills are one row, no mask: they pass enable_gqa
        for _ in range(10):
            engine.step()
    assert engine.cache.has_holes or engine.running < 2
    assert calls == []


def test_transformers_row_verbs_are_refused(tiny_llama):
    with epikv.attach(tiny_llama, "streaming", budget=16) as cache:
        tiny_llama(input_ids=torch.tensor([prompts(1)[0]]), **cache_kwargs(tiny_llama, cache), use_cache=True)
        for verb, arg in (("crop", -1), ("batch_select_indices", torch.tensor([0])), ("reorder_cache", None)):
            with pytest.raises(ValueError):
                getattr(cache.layers[0], verb)(arg)


@pytest.mark.exactness
@pytest.mark.parametrize(
    ("schedule", "expected"), [("after_interval", [6, 12, 18]), ("after_prefill", [5, 11, 17])]
)
def test_segq_first_compaction_schedule(tiny_llama, schedule, expected):
    """Hand-computed: a 12-token prompt at K = 16, recent 2, tau = 6. The authors' harness starts the
    tau counter at 0 after the prefill, so the row (over K from decode step 5) first compacts after
    step 6, then every 6; the other schedule starts the counter full and compacts as soon as the row
    is over K (step 5), then every 6."""
    params = {**policy_params("epikv"), "first_compaction": schedule, "recent": 2}
    with epikv.attach(tiny_llama, "epikv", budget=16, interval=6, **params) as cache:
        ids = torch.tensor([prompts(1)[0]])  # 12 tokens
        logits = tiny_llama(input_ids=ids, **cache_kwargs(tiny_llama, cache), use_cache=True).logits
        at = []
        for step in range(1, 19):
            before = cache.row_compactions[0]
            logits = tiny_llama(
                input_ids=logits[:, -1:].argmax(-1), **cache_kwargs(tiny_llama, cache), use_cache=True
            ).logits
            if cache.row_compactions[0] != before:
                at.append(step)
    assert at == expected
    assert cache.stats()[0].peak_cache_tokens == 22  # K + tau


def numbered_arena(rows: int, slots: int) -> Arena:
    """An arena whose every slot holds its row number + 1 (keys, values, positions, a buffer), all real."""
    arena = Arena(ArenaShape(layers=2, kv_heads=2, head_dim=3), torch.float32, torch.device("cpu"))
    arena.ensure(rows, slots, 0, 0, exact=True)
    arena.buffer("score", torch.zeros(1, rows, 1, slots))
    for row in range(rows):
        for store in (*arena.keys, *arena.values):
            store[row] = row + 1
        arena.positions[:, row] = row + 1
        arena.buffers["score"][:, row] = row + 1
    arena.valid[:] = True
    return arena


def row_numbers(arena: Arena, rows: int) -> list[int]:
    """The number each of the first ``rows`` rows holds (0 for a row of holes), checked uniform."""
    out = []
    for row in range(rows):
        if not arena.valid[row].any():
            assert (arena.positions[:, row] == -1).all() and (arena.buffers["score"][:, row] == 0).all()
            out.append(0)
            continue
        number = int(arena.positions[0, row, 0, 0])
        for tensor in (*(s[row] for s in (*arena.keys, *arena.values)), arena.buffers["score"][:, row]):
            assert (tensor == number).all()
        out.append(number)
    return out


def test_keep_rows_moves_the_kept_rows_forward_and_frees_the_rest():
    arena = numbered_arena(4, 5)
    arena.keep_rows([3, 1], rows=4, slots=5)  # row 1 stays where it is; row 3 fills the gap at 0
    assert row_numbers(arena, 4) == [4, 2, 0, 0]
    arena.keep_rows([1, 0], rows=2, slots=5)  # a swap reads every source before writing
    assert row_numbers(arena, 4) == [2, 4, 0, 0]


def test_append_rows_copies_other_rows_but_not_a_view_of_its_own():
    arena = numbered_arena(3, 4)
    view = arena.row_view(2)
    assert view.is_view_of(arena, 2) and not view.is_view_of(arena, 1)
    view.valid[0, 0] = False  # written through the view: the arena sees it, appending moves nothing
    arena.append_rows(view, 1, at=2, slots=4)
    assert not arena.valid[2, 0] and arena.valid[2, 1:].all()
    other = numbered_arena(2, 4)
    arena.append_rows(other, 2, at=1, slots=4)  # rows 0 and 1 of the other arena land at 1 and 2
    assert row_numbers(arena, 3) == [1, 1, 2]


def test_a_view_taken_before_the_arena_grew_is_no_longer_a_view():
    arena = numbered_arena(2, 4)
    view = arena.row_view(1)
    arena.ensure(8, 4, 2, 4)
    assert not view.is_view_of(arena, 1)  # it reads the old storage: appending it must copy
    arena.valid[1] = False
    arena.append_rows(view, 1, at=1, slots=4)
    assert row_numbers(arena, 2) == [1, 2]
