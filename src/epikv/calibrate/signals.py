"""Per-token epiphany signals at every layer, computed offline over a whole trace.

This module owns the calibration-time version of the policy's signal (paper §1.3): the step change
d_t = ||h_t - h_{t-1}||_2 of each decoder layer's output, and its causal rolling mean and rolling
z-score over the last ``window`` values in generation order. One forward pass with
``output_hidden_states=True`` replaces the policy's token-by-token bookkeeping; the rolling
statistics are vectorised and tested against :func:`epikv.scoring.rolling_zscore` /
:func:`epikv.scoring.push_window`, which the policy uses online.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from epikv.scoring import EPS

SIGNALS = ("raw", "mean", "zscore")
"""Signal names: raw d_t, rolling mean of d, rolling z-score of d (the policy's signal)."""


@torch.no_grad()
def step_changes(model: Any, ids: list[int], start: int, end: int) -> np.ndarray:
    """d_t at every decoder layer for positions ``start <= t < end`` of the token sequence ``ids``.

    ``start`` is the first generated token (the prompt length P), so d_P compares the first generated
    token's state with the last prompt token's, as the policy does after prefill. Returns (L, end -
    start) float32, L = number of decoder layers (``hidden_states[l + 1]`` is layer l's output).
    """
    if not 1 <= start < end <= len(ids):
        raise ValueError(f"need 1 <= start < end <= {len(ids)}, got start={start}, end={end}")
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids[:end]], dtype=torch.long, device=device)
    hidden = model(input_ids=input_ids, output_hidden_states=True, use_cache=False).hidden_states
    layers = torch.stack([h[0, start - 1 : end].float() for h in hidden[1:]])  # (L, T + 1, hidden)
    return torch.linalg.vector_norm(layers[:, 1:] - layers[:, :-1], dim=-1).cpu().numpy()


def _window_sums(d: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sums of d and d^2 over the last min(t + 1, window) values, and that count, along the last axis."""
    x = d.astype(np.float64)
    pad = [(0, 0)] * (x.ndim - 1) + [(1, 0)]
    c1 = np.pad(np.cumsum(x, axis=-1), pad)
    c2 = np.pad(np.cumsum(x * x, axis=-1), pad)
    t = np.arange(1, x.shape[-1] + 1)
    lo = np.maximum(t - window, 0)
    return c1[..., t] - c1[..., lo], c2[..., t] - c2[..., lo], (t - lo).astype(np.float64)


def rolling_mean(d: np.ndarray, window: int = 64) -> np.ndarray:
    """Causal mean of the last min(t + 1, window) values of d (..., T), the window including t."""
    s1, _, n = _window_sums(d, window)
    return (s1 / n).astype(np.float32)


def rolling_zscore(d: np.ndarray, window: int = 64) -> np.ndarray:
    """Causal rolling z-score of d (..., T): (d_t - mean) / (population std + 1e-6); 0 while t < 1.

    Same definition as :func:`epikv.scoring.rolling_zscore` applied after each
    :func:`epikv.scoring.push_window` (the window includes the current value).
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    s1, s2, n = _window_sums(d, window)
    mean = s1 / n
    std = np.sqrt(np.maximum(s2 / n - mean * mean, 0.0))
    z = (d.astype(np.float64) - mean) / (std + EPS)
    z[..., n < 2] = 0.0
    return z.astype(np.float32)


def all_signals(d: np.ndarray, window: int = 64) -> dict[str, np.ndarray]:
    """The three signals of :data:`SIGNALS` from step changes d (L, T); each (L, T) float32."""
    return {"raw": d.astype(np.float32), "mean": rolling_mean(d, window), "zscore": rolling_zscore(d, window)}
