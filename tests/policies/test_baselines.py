"""Baselines (issue #3): each score against a naive reference written here, and recompute == eager.

Naive references are plain Python loops over true positions, independent of the tensor code: H2O and
TOVA against the attention matrix of a full eager forward; SnapKV's and R-KV's ring of rows against a
per-position record of every row fed to a cache driven by hand; R-KV's near-duplicate rule, RaaS's
timestamps (ThinKV, LagKV and KeyDiff by hand: test_baselines_hand.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import epikv
from epikv import scoring
from epikv.cache import BudgetedCache, SlotView
from epikv.integration.compat import cache_kwargs
from epikv.policies import get_policy
from epikv.policies.base import ModelInfo, StepSignals
from epikv.policies.raas import RaaS
from epikv.policies.rkv import RKV
from epikv.policies.snapkv import SnapKV
from epikv.spec import CacheSpec
from tests.helpers.models import make_tiny

pytestmark = pytest.mark.exactness  # also run under vLLM's transformers (README's test command)

PROMPT = torch.tensor([[5, 17, 3, 44, 8, 9, 21, 60, 2, 11, 13, 70]])


def decode(model, cache, n, ids=PROMPT, each=None):
    """Greedy decode of n fed tokens; ``each(cache)`` after every forward. Returns the fed sequence."""
    logits = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True).logits
    fed = [ids]
    for _ in range(n):
        token = logits[:, -1].argmax(-1, keepdim=True)
        fed.append(token)
        logits = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits
        if each is not None:
            each(cache)
    return torch.cat(fed, dim=1)


@pytest.fixture(scope="module")
def eager_twin():
    """The tiny Llama with the same weights, in eager attention, for output_attentions references."""
    model = make_tiny("llama")
    model.set_attn_implementation("eager")
    return model


def full_attention(model, seq):
    """Attention matrices of every layer over the whole sequence, (layers, Hq, T, T)."""
    out = model(input_ids=seq, output_attentions=True, use_cache=False)
    return torch.stack([a[0] for a in out.attentions]).float()


# -- H2O and TOVA against the full attention matrix -------------------------------------------------


@pytest.mark.parametrize("mode", ["recompute", "eager"])
def test_h2o_buffers_are_running_column_sums(tiny_llama, eager_twin, mode):
    n, p = 20, PROMPT.shape[1]
    for name in ("h2o", "h2o-head"):
        seen: list[torch.Tensor] = []
        record = seen.append
        with epikv.attach(tiny_llama, name, budget=10_000, attention=mode) as cache:
            seq = decode(tiny_llama, cache, n, each=lambda c, record=record: record(c.buffers["h2o"].clone()))
        attn = full_attention(eager_twin, seq)  # (G, Hq, T, T)
        for i, got in enumerate(seen):
            t = p + i + 1  # queries and keys so far
            colsum = attn[:, :, :t, :t].sum(dim=2)  # (G, Hq, t): every query row so far, summed
            if name == "h2o":
                want = colsum.mean(dim=(0, 1))[None, None, None]
            else:
                want = torch.stack([colsum[:, 0:2].mean(1), colsum[:, 2:4].mean(1)], dim=1)[:, None]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_tova_buffer_is_current_row_head_mean(tiny_llama, eager_twin):
    seen = []
    with epikv.attach(tiny_llama, "tova", budget=10_000) as cache:
        seq = decode(tiny_llama, cache, 12, each=lambda c: seen.append(c.buffers["tova"].clone()))
    attn = full_attention(eager_twin, seq)
    for i, got in enumerate(seen):
        t = PROMPT.shape[1] + i
        want = attn[:, :, t, : t + 1].mean(dim=1)[:, None, None]  # (G, 1, 1, t + 1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# -- SnapKV and R-KV: the ring of rows, against a per-position record, through compactions -------------

INFO = ModelInfo("hand", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, hidden_size=16)


def drive(policy, budget, steps, check, prompt=5, seed=0):
    """Feed a budgeted cache random keys and random attention rows by hand. ``check(cache, record)``
    runs after each step; record[t] maps (layer, kv head, true position) -> that query's row value."""
    gen = torch.Generator().manual_seed(seed)
    spec = CacheSpec.build(INFO, policy, budget)
    policy = spec.policy
    cache = BudgetedCache(spec, INFO)
    record: list[dict] = []
    for step in range(steps):
        q = prompt if step == 0 else 1
        valid = torch.ones(1, q, dtype=torch.bool)
        positions = cache.next_positions(valid)
        cache.begin_step(valid, positions)
        for layer in range(2):
            k, v = torch.randn(2, 1, 2, q, 4, generator=gen)
            cache.update(k, v, layer)
        length = cache.valid.shape[1]
        w = min(q, policy.attention_rows())
        rows = {layer: torch.rand(1, 4, w, length, generator=gen) for layer in range(2)}
        how = "max" if isinstance(policy, RKV) else "mean"
        for r in range(w):
            row = {}
            for layer in range(2):
                pos = cache.layers[layer].positions[0].expand(2, -1)
                for h in range(2):
                    group = rows[layer][0, 2 * h : 2 * h + 2, r]
                    vals = group.mean(0) if how == "mean" else group.amax(0)
                    for j in range(length):
                        row[(layer, h, int(pos[h, j]))] = float(vals[j])
            record.append(row)
        signals = StepSignals(hidden={}, valid=valid, positions=positions, prefill=step == 0, attention=rows)
        cache.end_step(signals)
        check(cache, record)
    return cache


def naive_pool(values, kernel, how):
    half, out = kernel // 2, []
    for j in range(len(values)):
        window = [values[i] for i in range(j - half, j + half + 1) if 0 <= i < len(values)]
        out.append(sum(window) / kernel if how == "avg" else max(window))
    return out


@pytest.mark.parametrize("interval", [1, 3, 16])
def test_snapkv_window_rows_follow_the_slots(interval):
    policy = SnapKV(window=4, kernel=3, interval=interval, recent=2)

    def check(cache, record):
        got = cache.policy.score(cache.state, SlotView(cache, None, cache.budget))  # (G, 1, H, L)
        for layer in range(2):
            pos = cache.layers[layer].positions[0].expand(2, -1)
            for h in range(2):
                sums = [sum(r.get((layer, h, int(p)), 0.0) for r in record[-4:]) for p in pos[h]]
                want = naive_pool(sums, 3, "avg")
                assert got[layer, 0, h].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)

    cache = drive(policy, budget=12, steps=30, check=check)
    assert cache.compactions > 0
    heads = cache.layers[0].positions[0]
    assert not torch.equal(heads[0], heads[1]), "per-head selection expected"


def naive_rkv(record, keys, positions, alpha, lam, threshold):
    """R-KV's score of one (layer, head) from its rows by position and its keys (L, D), by loops."""
    length = len(positions)
    past = list(range(length - alpha))
    importance = [0.0] * length
    rows = [[r.get(p, 0.0) for p in positions] for r in record[-alpha:]]
    rows = [row for row in rows if sum(row[j] for j in past) > 0]
    for row in rows:
        mass = sum(row[j] for j in past)
        for j in past:
            importance[j] += row[j] / mass / len(rows)
    importance = naive_pool(importance, 7, "max")
    unit = [k / k.norm() for k in keys]
    sim = [[0.0 if i == j else float(unit[i] @ unit[j]) for j in range(length)] for i in range(length)]
    for i in range(length):
        dups = [j for j in range(length) if sim[i][j] > threshold]
        if dups:
            sim[i][max(dups)] = 0.0
    mean = [sum(sim[i][j] for i in range(length)) / length for j in range(length)]
    total = sum(math.exp(m) for m in mean)
    redundancy = [math.exp(m) / total for m in mean]
    z = [lam * importance[j] - (1 - lam) * redundancy[j] for j in range(length)]
    return z[: length - alpha] + [math.inf] * alpha


@pytest.mark.parametrize("interval", [1, 5])
def test_rkv_score_matches_loops(interval):
    policy = RKV(window=3, interval=interval, recent=3, threshold=0.2)
    checked = []

    def check(cache, record):
        got = cache.policy.score(cache.state, SlotView(cache, None, cache.budget))
        for layer in range(2):
            pos = cache.layers[layer].positions[0].expand(2, -1)
            for h in range(2):
                sub = [{p: r[(lyr, hh, p)] for (lyr, hh, p) in r if lyr == layer and hh == h} for r in record]
                keys = cache.layers[layer].keys[0, h]
                want = naive_rkv(sub, keys, pos[h].tolist(), 3, 0.1, 0.2)
                assert got[layer, 0, h].tolist() == pytest.approx(want, rel=1e-4, abs=1e-6)
        checked.append(True)

    cache = drive(policy, budget=12, steps=24, check=check, seed=1)
    assert cache.compactions > 0 and len(checked) == 24


def test_rkv_near_duplicate_rule_by_hand():
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [5.0, 5.0]])[None, None]
    valid = torch.tensor([[True, True, True, True, False]])  # slot 4 is a hole
    c = 1 / math.sqrt(1.01)  # cos(k0, k3)
    s = 0.1 / math.sqrt(1.01)  # cos(k2, k3)
    # rows after zeroing the diagonal and each row's newest near-duplicate (> 0.5):
    # row0 dups {1, 3} -> drop (0,3); row1 dups {0, 3} -> drop (1,3); row2 none;
    # row3 dups {0, 1} -> drop (3,1)
    kept = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, s], [c, 0, s, 0]]
    mean = [sum(kept[i][j] for i in range(4)) / 4 for j in range(4)]
    want = [*torch.softmax(torch.tensor(mean), dim=0).tolist(), 0.0]
    got = scoring.key_redundancy(keys, valid, 0.5)[0, 0].tolist()
    assert got == pytest.approx(want, rel=1e-5)
    # the newest copy of the repeated key is the least redundant of the three copies, the oldest the most
    assert got[3] < got[1] < got[0]


# -- RaaS, ThinKV, LagKV, KeyDiff on hand values ----------------------------------------------------


def test_raas_timestamps_hand_trace():
    info = ModelInfo("hand", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, hidden_size=2)
    policy = RaaS().resolve(info)
    state = policy.init_state(1, info, torch.device("cpu"))
    rows = [
        [0.5, 0.3, 0.2],
        [0.4, 0.1, 0.2, 0.3],
        [0.3, 0.1, 0.05, 0.25, 0.3],
        [0.2, 0.2, 0.3, 0.02, 0.08, 0.2],
    ]
    # generated slots (from 2 on) at or above the lower median of generated attention get "now"
    want = [[-1, -1, 0], [-1, -1, 1, 1], [-1, -1, 1, 2, 2], [-1, -1, 3, 2, 3, 3]]
    one = torch.ones(1, 1, dtype=torch.bool)
    prefill = StepSignals({}, torch.ones(1, 2, dtype=torch.bool), torch.tensor([[0, 1]]), True)
    prefill.attention = {0: torch.rand(1, 1, 1, 2)}
    buffers = policy.observe(state, prefill)
    assert buffers["raas"].tolist() == [[[[-1.0, -1.0]]]]
    for t, (row, expected) in enumerate(zip(rows, want, strict=True)):
        step = StepSignals({}, one, torch.tensor([[2 + t]]), False, buffers=buffers)
        step.attention = {0: torch.tensor(row)[None, None, None]}
        buffers = policy.observe(state, step)
        assert buffers["raas"][0, 0, 0].tolist() == expected


ATTENTION_POLICIES = {
    "h2o": {},
    "h2o-head": {},
    "tova": {},
    "snapkv": {"interval": 1, "window": 6},
    "rkv": {"interval": 4, "window": 4},
    "raas": {},
    "thinkv": {"interval": 8, "segment": 8, "classifier_layers": 2},
}


# ThinKV keeps the member nearest each K-means centroid: a choice that flips on the last-bit
# differences between eager and fused attention (the keys of later layers differ by ulps). Its tiers
# and per-segment retention must still agree; which member represents a cluster may not.
FLOAT_SENSITIVE = {"thinkv"}


@pytest.mark.parametrize("name", sorted(ATTENTION_POLICIES.keys() - FLOAT_SENSITIVE))
def test_recompute_and_eager_keep_the_same_tokens(tiny_model, name):
    kept, outputs = {}, {}
    for mode in ("recompute", "eager"):
        with epikv.attach(tiny_model, name, budget=28, attention=mode, **ATTENTION_POLICIES[name]) as cache:
            outputs[mode] = decode(tiny_model, cache, 40)
            kept[mode] = [layer.positions.clone() for layer in cache.layers]
            assert cache.compactions > 0
    assert torch.equal(outputs["recompute"], outputs["eager"])
    for a, b in zip(kept["recompute"], kept["eager"], strict=True):
        assert torch.equal(a, b)


def test_recompute_and_eager_give_thinkv_the_same_retention(tiny_model):
    segment, prompt = 8, PROMPT.shape[1]
    per_segment, sums = {}, {}
    for mode in ("recompute", "eager"):
        params = ATTENTION_POLICIES["thinkv"]
        with epikv.attach(tiny_model, "thinkv", budget=28, attention=mode, **params) as cache:
            logits = tiny_model(input_ids=PROMPT, **cache_kwargs(tiny_model, cache), use_cache=True).logits
            while cache.compactions == 0:  # up to the first compaction: same inputs in both modes
                token = logits[:, -1].argmax(-1, keepdim=True)
                logits = tiny_model(input_ids=token, **cache_kwargs(tiny_model, cache), use_cache=True).logits
            generated = cache.layers[0].positions[0, 0].long() - prompt
            per_segment[mode] = torch.bincount(generated[generated >= 0] // segment).tolist()
            sums[mode] = cache.state.extra.sums.clone()
    assert per_segment["recompute"] == per_segment["eager"]
    torch.testing.assert_close(sums["recompute"], sums["eager"], atol=1e-5, rtol=1e-4)


def test_every_baseline_is_registered_with_paper_defaults():
    assert get_policy("rkv").mix_lambda == 0.1 and get_policy("rkv").interval == 128
    assert (get_policy("snapkv").window, get_policy("snapkv").kernel) == (32, 5)
    assert (get_policy("h2o").n_sink, get_policy("h2o").granularity) == (4, "global")
    assert get_policy("h2o-head").recent_window(1024) == 512
    assert (get_policy("lagkv").n_sink, get_policy("lagkv").lag) == (4, 128)
    with pytest.raises(ValueError, match="window"):
        get_policy("snapkv", window=0)
    with pytest.raises(ValueError, match="schedule"):
        get_policy("thinkv", schedule=(4, 8))


def test_eager_colsum_ignores_padding_queries(tiny_llama):
    ids = torch.tensor([[0, 0, 0, 5, 17, 3], [9, 8, 7, 6, 5, 4]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    sums = {}
    for mode in ("recompute", "eager"):
        with epikv.attach(tiny_llama, "h2o", budget=100, attention=mode) as cache:
            tiny_llama(input_ids=ids, attention_mask=mask, **cache_kwargs(tiny_llama, cache), use_cache=True)
            sums[mode] = cache.buffers["h2o"].clone()
    torch.testing.assert_close(sums["recompute"], sums["eager"])
