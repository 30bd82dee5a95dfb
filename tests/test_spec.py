"""The run spec: one meaning for a budget, the smallest budget that really works, typed parameters."""

from __future__ import annotations

import pytest

from epikv.policies import policy_class
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec, parse_budget

INFO = ModelInfo("hand", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
BANDS = {"band_a": 1, "band_b": 2}


def spec(name: str, budget: int = 64, **params) -> CacheSpec:
    if getattr(policy_class(name), "uses_bands", False):
        params = {**BANDS, **params}
    return CacheSpec.build(INFO, name, budget, params=params)


@pytest.mark.parametrize("name", ["epikv", "epikv-flat", "h2o", "h2o-head", "streaming", "snapkv", "tova"])
@pytest.mark.parametrize("prompt", [1, 3, 10, 31, 38, 200, 700])
def test_min_budget_is_the_smallest_that_works(name, prompt):
    s = spec(name)
    k = s.min_budget(prompt)
    s.check_prompt(prompt, k)  # fits
    if k > 1:
        with pytest.raises(ValueError, match=f"the smallest budget that holds them is {k}$"):
            s.check_prompt(prompt, k - 1)


def test_the_hint_grows_with_the_recent_window():
    # prompt 30: K=38 must hold 30 + min(128, 38 // 4) = 39 > 38; K=39 holds 30 + 9 = 39 (the old
    # hint said "use >= 30 + 0" at K=3, then "38" at K=31, one step at a time)
    s = spec("epikv-flat")
    with pytest.raises(ValueError, match=r"prompt \(30\) \+ recent window \(0\) = 30; .* is 39$"):
        s.check_prompt(30, 3)
    with pytest.raises(ValueError, match=r"recent window \(9\) = 39; .* is 39$"):
        s.check_prompt(30, 38)
    assert s.min_budget(30) == 39


def test_a_prompt_past_k_runs_at_the_smallest_k_that_holds_it():
    """Issue 42 item 0: a prompt-protecting policy raises K for a long prompt instead of refusing it
    (prompt 798 at K 128: 798 + min(128, K // 4) <= K first at K = 926), and its cap follows."""
    flat = CacheSpec.build(INFO, "epikv-flat", 128, interval=16, params={"band_a": 1, "band_b": 2})
    assert flat.prompt_budget(96) == 128  # 96 + 32 fit
    assert flat.prompt_budget(100) == flat.prompt_budget(100, 64) == 133  # 100 + 33; 132 holds 100 + 33
    assert flat.prompt_budget(798) == flat.min_budget(798) == 926
    assert flat.cap_tokens(798) == 926 + 16 and flat.peak_tokens(798, 10) == 808
    sinks = CacheSpec.build(INFO, "streaming", 16, interval=4)  # 4 sinks + 4 recent fit any prompt
    assert sinks.prompt_budget(798) == 16 and sinks.cap_tokens(798) == 798
    assert CacheSpec.build(INFO, "full").prompt_budget(798) is None


def test_one_meaning_for_a_budget():
    assert parse_budget(256) == parse_budget("256") == 256 and parse_budget(None) is None
    for bad in (0, -1, "0", "full", "12.5", True):
        with pytest.raises(ValueError, match="use the policy 'full'"):
            parse_budget(bad)
    assert CacheSpec.build(INFO, "full", 160).budget is None  # full needs no budget, whatever is asked
    with pytest.raises(ValueError, match="evicts and needs a budget"):
        CacheSpec.build(INFO, "streaming", None)


def test_peak_tokens_is_the_reservation():
    s = spec("epikv", 256, first_compaction="after_prefill")  # tau 128
    assert s.peak_tokens(100, 50) == 150  # never reaches the budget
    assert s.peak_tokens(100, 2000) == 256 + 128
    # Seg-Q keeps the prompt: one past K runs at the K that holds it and its window, 500 + 128
    assert s.peak_tokens(500, 2000) == 500 + 128 + 128
    # Seg-Q's own schedule (the authors' harness): the first compaction waits tau decode steps, so a
    # prompt longer than its K is held whole for tau more tokens (here past the raised K: 300 + 96)
    harness = spec("epikv", 256)
    assert harness.policy.first_compaction == "after_interval"
    assert harness.peak_tokens(100, 2000) == 256 + 128
    assert harness.prompt_budget(300) == 399 and harness.peak_tokens(300, 2000) == 399 + 128
    assert harness.peak_tokens(500, 2000) == 628 + 128
    assert harness.peak_tokens(500, 60) == 560
    assert CacheSpec.build(INFO, "full").peak_tokens(100, 2000) == 2100


def test_bands_come_with_their_origin():
    s = spec("epikv-flat")
    assert (s.bands.band_a, s.bands.band_b, s.bands.origin) == (1, 2, "set as parameters")
    assert "bands A=1 B=2 (set as parameters)" in s.describe()
    assert s.config()["bands"] == {"band_a": 1, "band_b": 2, "origin": "set as parameters"}


def test_cap_tokens_is_the_one_rule_both_hosts_reserve_by():
    after_prefill = CacheSpec.build(INFO, "streaming", 64, interval=16)
    after_interval = CacheSpec.build(
        INFO, "streaming", 64, interval=16, params={"first_compaction": "after_interval"}
    )
    assert (after_prefill.first_since, after_interval.first_since) == (16, 0)
    # a prompt of at most K: K + tau; longer, held whole once: max(P, K + tau) or max(P, K) + tau
    assert [after_prefill.cap_tokens(p) for p in (10, 70, 100)] == [80, 80, 100]
    assert [after_interval.cap_tokens(p) for p in (10, 70, 100)] == [80, 86, 116]
    assert after_interval.cap_tokens(10, budget=32) == 48
    assert after_prefill.peak_tokens(50, 5) == 55 and after_prefill.peak_tokens(100, 500) == 100
    assert CacheSpec.build(INFO, "full").cap_tokens(100) is None
