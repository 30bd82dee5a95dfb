"""Baseline scores by hand (issue #3): ThinKV's tiers, levels and K-means choice, attention
sparsity, LagKV and KeyDiff against naive loops or hand-made values, and the pooling helpers."""

from __future__ import annotations

import math

import pytest
import torch

from epikv import scoring
from epikv.policies.thinkv import kmeans_representatives, plan_levels, thought_tiers


def test_thinkv_tiers_constructed():
    jitter = torch.tensor([0.0, 0.01, -0.01, 0.005])
    sparsity = torch.cat([0.9 + jitter, 0.1 + jitter, 0.5 + jitter])
    assert thought_tiers(sparsity).tolist() == [2] * 4 + [0] * 4 + [1] * 4  # densest = Reasoning
    # two segments: no KDE (too few), tertile fallback; the denser one is Reasoning
    assert thought_tiers(torch.tensor([0.8, 0.2])).tolist() == [1, 0]


def test_thinkv_progressive_levels_by_hand():
    schedule = (64, 32, 16, 8, 4)
    # kept 128 + 128 + 100 = 356 > 250: the T segment goes 64 (292), 32 (260), 16 (244) and stops
    assert plan_levels([128, 128, 100], [0, 2, 1], [0, 0, 0], schedule, 250) == [0, 3, 0]
    # T segments are lowered together (384 -> 320 -> 256 -> 224 -> 192) before the R segment is touched
    assert plan_levels([128, 128, 128], [2, 2, 0], [0, 0, 0], schedule, 300) == [1, 1, 0]
    assert plan_levels([128, 128, 128], [2, 2, 0], [0, 0, 0], schedule, 200) == [2, 2, 0]
    # nothing fits: every segment at the last level (4 each), never dropped
    assert plan_levels([128, 50], [0, 1], [0, 0], schedule, 3) == [5, 5]


def test_thinkv_kmeans_picks_cluster_centres():
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    offsets = torch.tensor([[-0.2, 0.0], [0.0, 0.0], [0.2, 0.0]])
    points = torch.cat([c + offsets for c in centres])  # the middle point of each cluster is its centre
    assert kmeans_representatives(points, 3).tolist() == [1, 4, 7]
    assert kmeans_representatives(points[:2], 3).tolist() == [0, 1]


def test_attention_sparsity_by_hand():
    rows = torch.tensor([[0.5, 0.004, 0.3, 0.0, 0.196]])  # the 0 is a hole; 0.004 < 1% of 0.5
    assert scoring.attention_sparsity(rows, 0.01).tolist() == [0.25]


def naive_lagkv(keys, values, positions, seen, n_sink, lag):
    """LagKV by loops over chunks of true positions (one head): softmax within the chunk of the
    next-chunk-normalised std, K and V averaged, rank / count; 1.0 where no complete successor."""
    out = [1.0] * len(positions)
    chunks: dict[int, list[int]] = {}
    for j, p in enumerate(positions):
        if p >= n_sink:
            chunks.setdefault((p - n_sink) // lag, []).append(j)
    for c, members in chunks.items():
        if n_sink + (c + 2) * lag > seen:
            continue
        ref = chunks[c + 1]
        combined = [0.0] * len(members)
        for x in (keys, values):
            mn, mx = x[ref].amin(0), x[ref].amax(0)
            spread = [float(((x[j] - mn) / (mx - mn + 1e-9)).std()) for j in members]
            total = sum(math.exp(s) for s in spread)
            for i, s in enumerate(spread):
                combined[i] += math.exp(s) / total / 2
        order = sorted(range(len(members)), key=lambda i: combined[i])
        for rank, i in enumerate(order):
            out[members[i]] = rank / len(members)
    return out


def test_lagkv_matches_loops_with_thinned_chunks():
    torch.manual_seed(3)
    positions = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18]  # 4 and 12 were evicted
    keys, values = torch.randn(len(positions), 3), torch.randn(len(positions), 3)
    seen = 19  # n_sink 2, lag 4: chunks [2,6) [6,10) [10,14) [14,18) [18,..); two have no full successor
    got = scoring.lag_chunk_scores(
        keys[None, None],
        values[None, None],
        torch.tensor(positions)[None, None],
        torch.ones(1, len(positions), dtype=torch.bool),
        torch.tensor([seen]),
        n_sink=2,
        lag=4,
    )[0, 0]
    want = naive_lagkv(keys, values, positions, seen, 2, 4)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert sum(w < 1 for w in want) == 10  # chunks 0-2 scored (thinned to 3 + 4 + 3 tokens)


def test_keydiff_by_hand():
    keys = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0], [0.0, 9.0]])[None, None]
    valid = torch.tensor([[True, True, True, False]])  # the hole is left out of the mean
    # normalised keys e1, e2, e1: mean (2/3, 1/3); cos with e1 = 2/sqrt(5), with e2 = 1/sqrt(5)
    got = scoring.keydiff_scores(keys, valid)[0, 0, :3].tolist()
    assert got == pytest.approx([-2 / math.sqrt(5), -1 / math.sqrt(5), -2 / math.sqrt(5)], rel=1e-5)


def test_pool_slots_and_group_heads_by_hand():
    x = torch.tensor([[3.0, 0.0, 6.0, 0.0]])
    assert scoring.pool_slots(x, 3, "avg").tolist() == [[1.0, 3.0, 2.0, 2.0]]
    assert scoring.pool_slots(x, 3, "max").tolist() == [[3.0, 6.0, 6.0, 6.0]]
    heads = torch.tensor([[[1.0], [3.0], [5.0], [9.0]]])  # (B=1, Hq=4, 1): KV head 0 <- 0,1; 1 <- 2,3
    assert scoring.group_heads(heads, 2, "mean").flatten().tolist() == [2.0, 7.0]
    assert scoring.group_heads(heads, 2, "max").flatten().tolist() == [3.0, 9.0]


# -- recompute == eager --------------------------------------------------------------------------------
