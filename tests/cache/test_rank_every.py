"""``rank_every`` (rho, issue 56) on epikv's engine: a row scores its cache every rho steps and in
between evicts, one token a step, the lowest-ranked token still present outside its protected
tokens, into whose slot its next token goes (peak K + 1)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.integration import model_info
from epikv.models.tiny import tiny_model
from epikv.policies.base import CacheView, ModelInfo, Policy, global_scores
from epikv.policies.rows import RowState
from epikv.spec import CacheSpec
from tests.helpers.engine import check_joining_equals_alone, prompts
from tests.helpers.models import policy_params

K = 24


def spec_for(model, name: str | Policy, rank_every: int | None, budget: int = K) -> CacheSpec:
    params = policy_params(name) if isinstance(name, str) else {}
    return CacheSpec.build(model_info(model), name, budget, interval=1, params=params, rank_every=rank_every)


def kept_sets(model, spec: CacheSpec, prompt: list[int], n: int = 50) -> list[tuple]:
    """The kept positions (per layer and head) after every eviction of one request, and its tokens."""
    trace: list = []

    def record(index: int, positions: torch.Tensor) -> None:
        sets = [tuple(sorted(p for p in row.tolist() if p >= 0)) for row in positions.flatten(0, 1)]
        trace.append((index, tuple(sets)))

    done = Engine(model, spec).run([Request(prompt, n, on_compaction=record)])[0]
    return [*trace, tuple(done.token_ids), done.peak_cache_tokens]


# -- the spec --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, "x", "2.5", True, 1.5])
def test_rank_every_refuses_what_is_not_a_positive_step_count(tiny_llama, bad):
    with pytest.raises(ValueError, match=re.escape(f"positive number of decode steps, got {bad!r}")):
        CacheSpec.build(model_info(tiny_llama), "keydiff", 32, rank_every=bad)


def test_rank_every_needs_interval_one_and_sets_it(tiny_llama):
    info = model_info(tiny_llama)
    with pytest.raises(ValueError, match="needs interval 1, got interval=4 with rank_every=8"):
        CacheSpec.build(info, "keydiff", 32, interval=4, rank_every=8)
    spec = CacheSpec.build(info, "epikv-segq", 32, params=policy_params("epikv-segq"), rank_every="16")
    assert (spec.interval, spec.rank_every, spec.cap_tokens(5)) == (1, 16, 33)
    assert spec.config()["rank_every"] == 16 and spec.record()["rank_every"] == 16
    assert "rank_every=16" in spec.describe()
    default = CacheSpec.build(info, "keydiff", 32)
    assert default.rank_every is None and "rank_every" not in default.config()  # records as before
    assert "rank_every" not in default.describe()
    assert CacheSpec.build(info, "full", rank_every=8).rank_every is None  # it never evicts


# -- the engine ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["keydiff", "random-head", "epikv-segq"])
def test_rho_one_keeps_what_tau_one_keeps(tiny_llama, name):
    prompt = prompts(1)[0]
    want = kept_sets(tiny_llama, spec_for(tiny_llama, name, None), prompt)
    got = kept_sets(tiny_llama, spec_for(tiny_llama, name, 1), prompt)
    assert len(want) > 20 and got == want


def test_a_static_ranking_keeps_what_tau_one_keeps_between_rankings(tiny_llama):
    """streaming-prompt scores by position: its ranking never goes stale, so evicting from an 8-step-old
    ranking (in place, unsorted slots, tokens newer than the ranking unranked) must keep exactly the
    sets that re-scoring every step keeps."""
    prompt = prompts(1)[0]
    want = kept_sets(tiny_llama, spec_for(tiny_llama, "streaming-prompt", None), prompt)
    got = kept_sets(tiny_llama, spec_for(tiny_llama, "streaming-prompt", 8), prompt)
    assert len(want) > 20 and got == want


@pytest.mark.parametrize("name", ["keydiff", "random-head", "streaming-prompt"])
def test_the_cache_never_holds_more_than_k_plus_one(tiny_llama, name):
    spec = spec_for(tiny_llama, name, 8)
    engine, widths = Engine(tiny_llama, spec), []
    for p in prompts(3):
        engine.submit(Request(p, 60))
    with engine:
        while engine.has_work():
            done = engine.step()
            books = engine.cache.books  # a 20-token prompt runs at K = 26 (prompt + window 6)
            widths.append(engine.cache.width - max(books.budgets, default=0))
            assert all(h <= k for h, k in zip(books.held, books.budgets, strict=True))  # after eviction
            assert all(f <= k + 1 for f, k in zip(books.fill, books.budgets, strict=True))
            assert all(c.peak_cache_tokens == c.budget + 1 for c in done)
    assert max(widths) == 1  # slots, not only tokens: the new token takes the freed slot


@pytest.mark.parametrize("name", ["keydiff", "random-head", "streaming-prompt"])
def test_a_row_batched_yields_what_it_yields_alone(tiny_llama, name):
    check_joining_equals_alone(tiny_llama, spec_for(tiny_llama, name, 8), prompts(2), name)


# -- the eviction, checked by hand -----------------------------------------------------------------
@dataclass
class Calls(RowState):
    calls: list[int]


@dataclass(frozen=True)
class Shifting(Policy[Calls]):
    """Scores that change at every call: ((p + 3c) * 7) mod 11 for position p at the row's c-th
    call, so a stale ranking and a fresh one disagree (ties are many: the older token goes first)."""

    name = "shifting"
    recent: int | None = 2

    def init_state(self, batch_size: int, model: ModelInfo, device: torch.device) -> Calls:
        return Calls([0] * batch_size)

    def score(self, state: Calls, view: CacheView) -> torch.Tensor:
        state.calls = [c + 1 for c in state.calls]
        c = torch.tensor(state.calls)[:, None]
        out = (((view.positions()[:, 0, :] + 3 * c) * 7) % 11).float()
        return global_scores(out.masked_fill(~view.valid, float("-inf")))


def reference(prompt: int, passes: int, k: int, rho: int, recent: int) -> list[tuple[int, ...]]:
    """The kept positions after every eviction, by the rule itself (sets, no slots)."""
    present, stored, ranked_at, calls, out = set(range(prompt)), {}, None, 0, []
    for t in range(1, passes + 1):
        seen = prompt + t
        present.add(seen - 1)
        if len(present) <= k:
            continue
        free = [p for p in present if prompt <= p < seen - recent]
        ranked = [p for p in free if p in stored]
        if ranked_at is None or t - ranked_at >= rho or not ranked:
            calls, ranked_at = calls + 1, t
            stored = {p: ((p + 3 * calls) * 7) % 11 for p in present}
            ranked = free
        victim = min(ranked, key=lambda p: (stored[p], p))
        present.discard(victim)
        stored.pop(victim)
        out.append(tuple(sorted(present)))
    return out


@pytest.mark.parametrize("rho", [1, 4, 9])
def test_each_step_evicts_the_lowest_ranked_token_still_present(tiny_llama, rho):
    prompt, k, n = prompts(2)[1], 12, 40  # 5 prompt tokens; a window of 2 < rho: unranked tokens leave it
    got = kept_sets(tiny_llama, spec_for(tiny_llama, Shifting(), rho, budget=k), prompt, n)
    sets = [s[0] for _, s in got[:-2]]
    assert sets == reference(len(prompt), n - 1, k, rho, recent=2)
    assert got[-1] == k + 1


def test_a_static_ranking_on_a_hybrid_model_too():
    """Sliding-window layers keep their rings; the global layers' mask reads the slots written in place."""
    model = tiny_model("gemma3_text")
    want = kept_sets(model, spec_for(model, "streaming-prompt", None), prompts(1)[0])
    got = kept_sets(model, spec_for(model, "streaming-prompt", 8), prompts(1)[0])
    assert len(want) > 20 and got == want
