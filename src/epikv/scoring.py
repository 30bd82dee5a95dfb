"""Pure tensor scoring functions used by the policies.

This module owns the arithmetic of every score (EpiKV's step change and rolling z-score, the lag
normalisation, Seg tiers, recent-query relevance). It knows nothing of models, caches or policies:
every function takes tensors and returns tensors, so each one is tested on CPU against a
hand-computed or naive reference. Shapes use B = batch, H = KV heads, Hq = query heads, L = cached
slots, D = head dim, W = window.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def step_change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """L2 norm of the hidden-state change between consecutive tokens (paper §1.3 step 1).

    current, previous: (B, hidden). Returns (B,) float32.
    """
    return torch.linalg.vector_norm((current - previous).float(), dim=-1)


def rolling_zscore(window: torch.Tensor, count: int) -> torch.Tensor:
    """Causal rolling z-score of the newest value against a window that includes it.

    window: (B, W) holding the last min(count, W) values in its *last* columns (older first);
    count: how many values have been seen so far (all rows step together).
    Population std, epsilon 1e-6, and 0 while fewer than two values exist (paper §1.3 step 3).
    Returns (B,) float32.
    """
    n = min(count, window.shape[-1])
    if n < 2:
        return torch.zeros(window.shape[0], dtype=torch.float32, device=window.device)
    values = window[:, -n:].float()
    mean = values.mean(dim=-1)
    std = values.std(dim=-1, correction=0)
    return (values[:, -1] - mean) / (std + EPS)


def push_window(window: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Shift a (B, W) window left by one and append value (B,) at the end; returns the new window."""
    return torch.cat([window[:, 1:], value.to(window.dtype).unsqueeze(-1)], dim=-1)


def epiphany_score(z_a: torch.Tensor, z_b: torch.Tensor, band_mode: str) -> torch.Tensor:
    """Combine the band z-scores: ``diff`` = z_A - z_B (the paper's form), ``a_only``, ``b_only`` = -z_B."""
    if band_mode == "diff":
        return z_a - z_b
    if band_mode == "a_only":
        return z_a
    if band_mode == "b_only":
        return -z_b
    raise ValueError(f"band_mode must be 'diff', 'a_only' or 'b_only', got {band_mode!r}")


def lag_normalized_spread(x: torch.Tensor, lag: int, reference: str = "previous") -> torch.Tensor:
    """Per-token spread of lag-normalised states (LagKV, and EpiKV's causal variant, paper §1.5/§2.8).

    x: (B, H, L, D) keys or values. Positions are cut into chunks of ``lag`` starting at 0. Each chunk is
    min-max normalised per head and channel against a reference chunk: the *previous* chunk (EpiKV's
    causal form; the first chunk is left unnormalised) or the *next* chunk (original LagKV; chunks
    without a full next chunk get NaN, meaning "not scored"). Returns (B, H, L): std over D
    (population) of the normalised vectors.
    """
    if reference not in ("previous", "next"):
        raise ValueError(f"reference must be 'previous' or 'next', got {reference!r}")
    b, h, length, _ = x.shape
    out = torch.full((b, h, length), float("nan"), dtype=torch.float32, device=x.device)
    n_chunks = (length + lag - 1) // lag
    xf = x.float()
    for c in range(n_chunks):  # a handful of chunks per compaction, not a per-token loop
        lo, hi = c * lag, min((c + 1) * lag, length)
        ref_index = c - 1 if reference == "previous" else c + 1
        if reference == "next" and (ref_index + 1) * lag > length:
            continue
        chunk = xf[:, :, lo:hi]
        if ref_index >= 0:
            ref = xf[:, :, ref_index * lag : (ref_index + 1) * lag]
            mn, mx = ref.amin(dim=2, keepdim=True), ref.amax(dim=2, keepdim=True)
            chunk = (chunk - mn) / (mx - mn + 1e-9)
        out[:, :, lo:hi] = chunk.std(dim=-1, correction=0)
    return out


def key_variance(keys: torch.Tensor) -> torch.Tensor:
    """Per-slot key variance over head_dim averaged over heads (Seg tiers, §1.6 step 2).

    keys: (B, H, L, D) or (N, B, H, L, D) for N layers (averaged too). Returns (B, L).
    """
    var = keys.float().var(dim=-1, correction=0)
    if var.dim() == 4:
        var = var.mean(dim=0)
    return var.mean(dim=1)


def segment_tiers(stat: torch.Tensor) -> torch.Tensor:
    """Tertile tiers of segment statistics (§1.6 step 4): 0 = R (top third), 1 = E, 2 = T.

    stat: (S,) one statistic per segment. Thresholds are the sorted values at indices floor(S/3) and
    floor(2S/3); a segment at or above the upper threshold is R, at or above the lower one is E.
    """
    s = stat.shape[0]
    if s == 0:
        return torch.zeros(0, dtype=torch.long, device=stat.device)
    ordered = stat.sort().values
    low, high = ordered[s // 3], ordered[min(2 * s // 3, s - 1)]
    tiers = torch.full_like(stat, 2, dtype=torch.long)
    tiers[stat >= low] = 1
    tiers[stat >= high] = 0
    return tiers


def segment_keep(
    scores: torch.Tensor,
    candidate: torch.Tensor,
    tiers: torch.Tensor,
    caps: tuple[int, int, int],
    segment: int,
    budget: int,
) -> torch.Tensor:
    """Seg's oldest-first capped selection for one sequence (§1.6 steps 5-6).

    scores: (L,) within-segment ranking score; candidate: (L,) bool, slots that may be chosen (decode
    tokens outside the recent window); tiers: (S,) tier of each ``segment``-slot segment covering
    slots [0, S*segment); caps: tokens kept per tier (R, E, T); budget: tokens to spend in total.
    Walks segments oldest first and keeps the top min(cap, budget left) candidates of each.
    Returns (L,) bool of chosen slots.
    """
    chosen = torch.zeros_like(candidate)
    left = budget
    for seg_index in range(tiers.shape[0]):  # one iteration per 128-slot segment, at compaction only
        if left <= 0:
            break
        lo, hi = seg_index * segment, (seg_index + 1) * segment
        cand = candidate[lo:hi]
        n_cand = int(cand.sum())
        take = min(caps[int(tiers[seg_index])], left, n_cand)
        if take <= 0:
            continue
        seg_scores = scores[lo:hi].masked_fill(~cand, float("-inf"))
        top = seg_scores.topk(take).indices + lo
        chosen[top] = True
        left -= take
    return chosen


def qk_relevance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
) -> torch.Tensor:
    """Relevance of each cached slot to the recent queries (Seg-Q, §1.7).

    queries: (B, Hq, W, D) post-RoPE; keys: (B, H, L, D) post-RoPE with Hq a multiple of H (GQA);
    query_positions: (B, W); key_positions: (B, L); key_valid: (B, L) bool.
    softmax(q·kᵀ/√D) over slots with a causal mask (a key is visible to a query when its position is
    not after the query's), averaged over the W queries and all heads. Returns (B, L) float32.
    """
    hq, d = queries.shape[1], queries.shape[3]
    h = keys.shape[1]
    k = keys.float().repeat_interleave(hq // h, dim=1)
    logits = torch.einsum("bhwd,bhld->bhwl", queries.float(), k) / d**0.5
    visible = key_valid[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.mean(dim=(1, 2))


def masked_zscore(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """z-normalise each row of x (B, L) over the entries where mask is True; others are returned as 0."""
    m = mask.float()
    n = m.sum(dim=-1, keepdim=True).clamp_min(1.0)
    mean = (x * m).sum(dim=-1, keepdim=True) / n
    var = (((x - mean) * m) ** 2).sum(dim=-1, keepdim=True) / n
    return ((x - mean) / (var.sqrt() + EPS)) * m
