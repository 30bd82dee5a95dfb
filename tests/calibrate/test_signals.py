"""Offline signals equal the policy's online arithmetic (scoring.push_window / rolling_zscore)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from epikv import scoring
from epikv.calibrate.signals import all_signals, rolling_mean, rolling_zscore, step_changes
from epikv.integration.compat import cache_kwargs


def _online(d: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The policy's loop: push each value, then z-score (and mean) the window's last count values."""
    win = torch.zeros(d.shape[0], window)
    zs, means = [], []
    for t in range(d.shape[1]):
        win = scoring.push_window(win, torch.from_numpy(d[:, t]).float())
        zs.append(scoring.rolling_zscore(win, t + 1))
        means.append(win[:, -min(t + 1, window) :].mean(dim=-1))
    return torch.stack(zs, -1).numpy(), torch.stack(means, -1).numpy()


@pytest.mark.parametrize("window", [2, 5, 64])
def test_rolling_statistics_match_the_online_policy(window):
    # Distinct values 0.1 apart: the policy works in float32, and near-equal values in a window of
    # two would turn its rounding into large z-score differences.
    rng = np.random.default_rng(window)
    d = np.stack([rng.choice(1000, 90, replace=False) / 10.0 for _ in range(3)]).astype(np.float32)
    z_ref, mean_ref = _online(d, window)
    np.testing.assert_allclose(rolling_zscore(d, window), z_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(rolling_mean(d, window), mean_ref, rtol=1e-5, atol=1e-5)
    assert (rolling_zscore(d, window)[:, 0] == 0).all()


def test_all_signals_shapes_and_window_check():
    d = np.ones((4, 10), np.float32)
    out = all_signals(d, 3)
    assert set(out) == {"raw", "mean", "zscore"} and all(v.shape == (4, 10) for v in out.values())
    with pytest.raises(ValueError, match="window"):
        rolling_zscore(d, 1)


def test_step_changes_match_token_by_token_decoding(tiny_llama):
    ids = torch.randint(2, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    start = 10
    got = step_changes(tiny_llama, ids[0].tolist(), start, 24)
    cache, states = DynamicCache(), []
    with torch.no_grad():
        out = tiny_llama(
            input_ids=ids[:, :start],
            **cache_kwargs(tiny_llama, cache),
            use_cache=True,
            output_hidden_states=True,
        )
        states.append(torch.stack([h[0, -1] for h in out.hidden_states[1:]]))
        for t in range(start, 24):
            out = tiny_llama(
                input_ids=ids[:, t : t + 1],
                **cache_kwargs(tiny_llama, cache),
                use_cache=True,
                output_hidden_states=True,
            )
            states.append(torch.stack([h[0, -1] for h in out.hidden_states[1:]]))
    h = torch.stack(states, dim=1)  # (L, T + 1, hidden): last prompt token, then each decoded token
    expected = torch.stack([scoring.step_change(h[:, i + 1], h[:, i]) for i in range(h.shape[1] - 1)], -1)
    assert got.shape == (4, 14)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="start"):
        step_changes(tiny_llama, ids[0].tolist(), 0, 5)
