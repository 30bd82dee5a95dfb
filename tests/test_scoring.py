"""Pure scoring functions against naive or hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from epikv import scoring


def test_step_change_is_l2_norm():
    a = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    b = torch.zeros(2, 2)
    assert torch.allclose(scoring.step_change(a, b), torch.tensor([5.0, math.sqrt(2)]))


def naive_rolling_z(values: list[float], window: int) -> list[float]:
    out = []
    for t in range(len(values)):
        w = values[max(0, t - window + 1) : t + 1]
        if len(w) < 2:
            out.append(0.0)
            continue
        mean = sum(w) / len(w)
        std = math.sqrt(sum((x - mean) ** 2 for x in w) / len(w))
        out.append((w[-1] - mean) / (std + 1e-6))
    return out


@pytest.mark.parametrize("window", [2, 5, 64])
def test_rolling_zscore_matches_naive(window):
    torch.manual_seed(1)
    values = torch.rand(150).tolist()
    win = torch.zeros(1, window)
    got = []
    for count, v in enumerate(values, start=1):
        win = scoring.push_window(win, torch.tensor([v]))
        got.append(float(scoring.rolling_zscore(win, count)))
    assert got == pytest.approx(naive_rolling_z(values, window), abs=1e-4)


def test_rolling_zscore_hand_value():
    # window [1, 2, 3]: mean 2, population std sqrt(2/3); newest 3 -> z = 1 / 0.8165
    win = torch.tensor([[1.0, 2.0, 3.0]])
    assert float(scoring.rolling_zscore(win, 3)) == pytest.approx(1 / math.sqrt(2 / 3), rel=1e-5)
    assert float(scoring.rolling_zscore(win, 1)) == 0.0


def test_epiphany_modes():
    za, zb = torch.tensor([2.0]), torch.tensor([0.5])
    assert float(scoring.epiphany_score(za, zb, "diff")) == 1.5
    assert float(scoring.epiphany_score(za, zb, "a_only")) == 2.0
    assert float(scoring.epiphany_score(za, zb, "b_only")) == -0.5
    with pytest.raises(ValueError, match="band_mode"):
        scoring.epiphany_score(za, zb, "sum")


def test_lag_normalization_previous_chunk_by_hand():
    # one head, D = 2, lag 2: chunk 0 = slots 0-1 (unnormalised), chunk 1 normalised by chunk 0's min/max
    x = torch.tensor([[0.0, 10.0], [2.0, 20.0], [1.0, 15.0], [2.0, 10.0], [5.0, 5.0]])[None, None]
    got = scoring.lag_normalized_spread(x, lag=2, reference="previous")[0, 0]
    # slot 0: std of (0, 10) = 5; slot 2: normalised (0.5, 0.5) -> 0; slot 3: (1, 0) -> 0.5
    # slot 4 (chunk 2, reference chunk 1 = slots 2-3: min (1, 10), max (2, 15)): (4, -1) -> 2.5
    assert got[0] == pytest.approx(5.0)
    assert got[2] == pytest.approx(0.0, abs=1e-6)
    assert got[3] == pytest.approx(0.5, abs=1e-6)
    assert got[4] == pytest.approx(2.5, abs=1e-5)


def test_lag_normalization_next_chunk_leaves_last_unscored():
    x = torch.arange(12.0).reshape(1, 1, 6, 2)
    got = scoring.lag_normalized_spread(x, lag=2, reference="next")[0, 0]
    assert torch.isnan(got[4:]).all() and not torch.isnan(got[:4]).any()


def test_key_variance_mean_over_heads_and_layers():
    keys = torch.tensor([[[[0.0, 2.0]], [[1.0, 1.0]]]])  # (B=1, H=2, L=1, D=2): variances 1, 0
    assert scoring.key_variance(keys).tolist() == [[0.5]]
    stacked = torch.stack([keys, keys * 2])  # second layer variance 4, 0 -> mean 2
    assert scoring.key_variance(stacked).tolist() == [[1.25]]


def test_key_variance_of_float32_keys_is_torch_var_bit_for_bit():
    """The kept sets of float32 runs do not move: over 98,304 rows of keys with an offset mean (a
    two-pass variance in float32 differs from ``torch.var`` on some of them)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 4, 3, 4096, 64, generator=gen) * 3 + torch.randn(2, 4, 3, 1, 64, generator=gen)
    ref = keys.var(dim=-1, correction=0).mean(dim=0).mean(dim=1)
    assert torch.equal(scoring.key_variance(keys), ref)
    x = keys.float()
    in_float32 = (x - x.mean(dim=-1, keepdim=True)).square().mean(dim=-1).mean(dim=0).mean(dim=1)
    assert not torch.equal(in_float32, ref)  # the precision is what keeps it exact


def test_key_variance_of_bfloat16_keys_is_the_exact_variance_rounded_to_even():
    """bfloat16 keys: every row's variance is the exact one rounded to the nearest float32 (ties to
    even), checked with rational arithmetic on rows whose exact variance is a tie."""
    from fractions import Fraction

    gen = torch.Generator().manual_seed(1)
    keys = (torch.randn(1, 1, 20000, 64, generator=gen) * 2).bfloat16()
    got = scoring.key_variance(keys)[0]
    welford = keys.float().var(dim=-1, correction=0)[0, 0]
    differ = (got != welford).nonzero().squeeze(-1).tolist()
    assert differ  # such ties exist in bfloat16 keys; torch.var does not always round them to even
    for i in differ[:20]:
        row = [Fraction(v) for v in keys[0, 0, i].float().tolist()]
        mean = sum(row) / len(row)
        exact = sum((v - mean) ** 2 for v in row) / len(row)
        nearest = float(torch.tensor(float(exact), dtype=torch.float64).float())  # ties to even
        assert float(got[i]) == nearest


def test_segment_tiers_tertiles():
    stat = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.2])
    # sorted: .1 .2 .3 .5 .7 .9 -> low = sorted[2] = .3, high = sorted[4] = .7
    assert scoring.segment_tiers(stat).tolist() == [2, 0, 1, 1, 0, 2]


def test_segment_keep_caps_oldest_first_and_budget():
    scores = torch.arange(12.0)
    candidate = torch.ones(12, dtype=torch.bool)
    candidate[0] = False  # a prompt slot
    tiers = torch.tensor([0, 2, 1])  # segments of 4: R, T, E
    chosen = scoring.segment_keep(scores, candidate, tiers, caps=(2, 3, 1), segment=4, budget=5)
    # R segment keeps its 2 best (3, 2); T keeps 1 (7); E would keep 3 but only 2 budget left (11, 10)
    assert chosen.nonzero().flatten().tolist() == [2, 3, 7, 10, 11]


def test_qk_relevance_matches_explicit_softmax():
    torch.manual_seed(0)
    b, hq, h, w, length, d = 2, 4, 2, 3, 7, 8
    q, k = torch.randn(b, hq, w, d), torch.randn(b, h, length, d)
    qpos = torch.tensor([[4, 5, 6], [4, 5, 6]])
    kpos = torch.arange(length).repeat(b, 1)
    valid = torch.ones(b, length, dtype=torch.bool)
    valid[1, 0] = False
    got = scoring.qk_relevance(q, k, qpos, kpos, valid)
    want = torch.zeros(b, length)
    for bi in range(b):
        for head in range(hq):
            for wi in range(w):
                row = torch.full((length,), float("-inf"))
                for j in range(length):
                    if valid[bi, j] and kpos[bi, j] <= qpos[bi, wi]:
                        row[j] = q[bi, head, wi] @ k[bi, head // (hq // h), j] / math.sqrt(d)
                want[bi] += torch.softmax(row, dim=0) / (hq * w)
    assert torch.allclose(got, want, atol=1e-6)
    assert got[1, 0] == 0


def test_gqa_logits_pair_each_query_head_with_its_kv_head():
    """Hand loop: query head i reads KV head i // (Hq / H), scaled by 1/sqrt(D), in float32 even
    from bf16 inputs; a head pairing off by one group would fail."""
    torch.manual_seed(1)
    b, hq, h, q, length, d = 2, 6, 3, 2, 5, 4
    queries, keys = torch.randn(b, hq, q, d).bfloat16(), torch.randn(b, h, length, d).bfloat16()
    got = scoring.gqa_logits(queries, keys)
    assert got.dtype == torch.float32 and got.shape == (b, hq, q, length)
    for bi in range(b):
        for head in range(hq):
            for qi in range(q):
                for j in range(length):
                    want = (
                        queries[bi, head, qi].float() @ keys[bi, head // (hq // h), j].float() / math.sqrt(d)
                    )
                    assert torch.isclose(got[bi, head, qi, j], want, atol=1e-5)


def test_masked_zscore():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[True, True, True, False]])
    z = scoring.masked_zscore(x, mask)
    assert z[0, 3] == 0
    assert z[0, :3].tolist() == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-3)


def test_key_variance_in_slices_changes_no_bit_and_holds_no_whole_float64_copy(monkeypatch):
    """Issue 57: the variance is taken over slices of L holding at most VARIANCE_CHUNK_BYTES of float64
    (the whole-tensor float64 copy and its centred copy were 16 bytes an element beside float32 keys)."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 4, 3, 500, 64, generator=gen) * 3 + torch.randn(2, 4, 3, 1, 64, generator=gen)
    whole = keys.double()
    want = (whole - whole.mean(dim=-1, keepdim=True)).square().mean(dim=-1).float()  # (N, B, H, L)
    for chunk in (1, 8 * 64 * 24 * 7, 1 << 30):  # a slot a slice, seven slots, all at once
        monkeypatch.setattr(scoring, "VARIANCE_CHUNK_BYTES", chunk)
        assert torch.equal(scoring.slot_variance(keys), want)
        assert torch.equal(scoring.key_variance(keys), want.mean(dim=0).mean(dim=1))
    monkeypatch.setattr(scoring, "VARIANCE_CHUNK_BYTES", 8 * 64 * 24 * 7)
    from epikv.bench.shared.machine import peak_allocated

    result = 2 * 4 * 3 * 500 * 4
    extra = peak_allocated(lambda: scoring.slot_variance(keys)) - result
    assert 0 < extra <= scoring.VARIANCE_CHUNK_BYTES + 7 * 24 * 8 + 1024, extra  # + the slice's means
