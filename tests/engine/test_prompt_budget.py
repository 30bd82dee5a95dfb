"""Issue 42 item 0 on epikv's engine: a prompt whose protected tokens pass K runs at the smallest K
that holds them, exactly as a request asked at that K, alone or in a batch."""

from __future__ import annotations

from epikv.engine import Engine, Request
from epikv.integration import build_spec
from tests.engine.test_observers import Kept
from tests.helpers.engine import prompts

PARAMS = {"band_a": 1, "band_b": 2}


def test_a_long_prompt_runs_as_the_same_request_at_its_raised_k(tiny_llama):
    long = list(range(2, 42))  # 40 tokens; K 16 holds 4 recent: raised to 53 (40 + 53 // 4 = 53)
    asked = build_spec(tiny_llama, "epikv-flat", 16, interval=4, params=PARAMS)
    raised = build_spec(tiny_llama, "epikv-flat", 53, interval=4, params=PARAMS)
    assert asked.prompt_budget(len(long)) == 53
    kept, want_kept = Kept(), Kept()
    got = Engine(tiny_llama, asked).run([Request(long, 40, on_compaction=kept)])[0]
    want = Engine(tiny_llama, raised).run([Request(long, 40, on_compaction=want_kept)])[0]
    assert got.token_ids == want.token_ids and kept.events == want_kept.events
    assert got.budget == want.budget == 53 and got.compactions > 0 and got.evictions > 0
    assert got.peak_cache_tokens <= 53 + 4
    for index, layers in kept.events:  # the prompt and the 13 newest tokens, nothing else
        seen = 40 + index
        want = [*range(40), *range(seen - 13, seen)]
        assert all(sorted(head) == want for layer in layers for head in layer), index


def test_in_a_batch_the_raised_row_and_a_short_one_keep_their_solo_tokens(tiny_llama):
    spec = build_spec(tiny_llama, "epikv-flat", 16, interval=4, params=PARAMS)
    batch = [Request(prompts()[1], 30), Request(list(range(2, 42)), 30)]
    together = Engine(tiny_llama, spec).run(batch)
    for request, got in zip(batch, together, strict=True):
        alone = Engine(tiny_llama, spec).run([Request(request.prompt_ids, 30)])[0]
        assert got.token_ids == alone.token_ids and got.budget == alone.budget
    assert [done.budget for done in together] == [16, 53]
