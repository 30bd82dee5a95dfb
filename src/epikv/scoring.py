"""Pure tensor scoring functions used by the policies.

This module owns the arithmetic of every score (EpiKV's step change and rolling z-score, the lag
normalisation, Seg tiers, recent-query relevance). It knows nothing of models, caches or policies:
every function takes tensors and returns tensors, so each one is tested on CPU against a
hand-computed or naive reference. Shapes use B = batch, H = KV heads, Hq = query heads, L = cached
slots, D = head dim, W = window.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-6


def step_change(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """L2 norm of the hidden-state change between consecutive tokens (paper §1.3 step 1).

    current, previous: (B, hidden). Returns (B,) float32.
    """
    return torch.linalg.vector_norm((current - previous).float(), dim=-1)


def rolling_zscore(window: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """Causal rolling z-score of the newest value against a window that includes it.

    window: (B, W) holding the last min(count, W) values in its *last* columns (older first);
    count: how many values each row has seen so far, (B,) or one int for every row.
    Population std, epsilon 1e-6, and 0 while a row has fewer than two values (paper §1.3 step 3).
    Returns (B,) float32.
    """
    b, w = window.shape
    n = torch.as_tensor(count, device=window.device).clamp(max=w).expand(b)
    values = window.float()
    inside = (torch.arange(w, device=window.device)[None, :] >= (w - n)[:, None]).float()
    size = n.clamp_min(1).float()
    mean = (values * inside).sum(dim=-1) / size
    std = ((((values - mean[:, None]) * inside) ** 2).sum(dim=-1) / size).sqrt()
    z = (values[:, -1] - mean) / (std + EPS)
    return torch.where(n >= 2, z, torch.zeros_like(z))


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


VARIANCE_CHUNK_BYTES = 16 << 20
"""The most float64 temporary bytes :func:`slot_variance` holds at once (issue 57: a whole float64
copy of a layer's keys at 16 rows of K = 4,096 in a Llama-8B shape is 0.55 GB, and each pass made
another)."""


def slot_variance(keys: torch.Tensor) -> torch.Tensor:
    """Population variance over the last dim of every vector of ``keys`` (..., L, D) -> (..., L) float32.

    Two passes in float64, rounded once to float32: the variance of float32 keys as ``torch.var``
    gives it (its Welford recurrence in float64), bit for bit on every row checked, several times
    faster on an AVX2 CPU (docs/vllm-bench.md). On keys held in bfloat16 a few rows in ten thousand
    have a variance exactly halfway between two float32 values; this rounds it to even,
    ``torch.var`` to either side. Computed over slices of L holding at most
    :data:`VARIANCE_CHUNK_BYTES` of float64, so no float64 copy of the whole tensor exists; each
    vector's variance is its own reduction, so the slicing changes no bit.
    """
    *lead, length, d = keys.shape
    out = torch.empty(*lead, length, dtype=torch.float32, device=keys.device)
    per_slot = max(1, d * 8 * math.prod(lead))
    step = max(1, VARIANCE_CHUNK_BYTES // per_slot)
    for lo in range(0, length, step):
        out[..., lo : lo + step] = _variance64(keys[..., lo : lo + step, :])
    return out


def _variance64(keys: torch.Tensor) -> torch.Tensor:
    """:func:`slot_variance` of one slice: its one float64 temporary is freed on return, before the
    next slice's is made."""
    x = keys.double()
    return x.sub_(x.mean(dim=-1, keepdim=True)).square_().mean(dim=-1)


def key_variance(keys: torch.Tensor) -> torch.Tensor:
    """Per-slot key variance over head_dim averaged over heads (Seg tiers, §1.6 step 2).

    keys: (B, H, L, D) or (N, B, H, L, D) for N layers (averaged too). Returns (B, L). Each key's
    variance is :func:`slot_variance`'s.
    """
    var = slot_variance(keys)
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


def gqa_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q·kᵀ/√D in float32 of queries (B, Hq, q, D) against keys (B, H, L, D), Hq a multiple of H,
    query head i reading KV head i // (Hq / H) (transformers' ``repeat_kv`` layout). Each KV head's
    query heads are one matrix product, so the keys are never repeated. Returns (B, Hq, q, L)."""
    b, hq, q, d = queries.shape
    h, length = keys.shape[1], keys.shape[2]
    grouped = queries.float().reshape(b, h, (hq // h) * q, d)
    return (torch.matmul(grouped, keys.float().transpose(-1, -2)) / d**0.5).view(b, hq, q, length)


def qk_relevance(
    queries: torch.Tensor,
    keys: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    query_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Relevance of each cached slot to the recent queries (Seg-Q, §1.7).

    queries: (B, Hq, W, D) post-RoPE; keys: (B, H, L, D) post-RoPE with Hq a multiple of H (GQA);
    query_positions: (B, W); key_positions: (B, L); key_valid: (B, L) bool; query_valid: (B, W) bool,
    False for query slots a row does not have yet (None = all real).
    softmax(q·kᵀ/√D) over slots with a causal mask (a key is visible to a query when its position is
    not after the query's), averaged over a row's real queries and all heads. Returns (B, L) float32.
    """
    hq = queries.shape[1]
    logits = gqa_logits(queries, keys)
    visible = key_valid[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if query_valid is None:
        return probs.mean(dim=(1, 2))
    weight = query_valid.float()[:, None, :, None]
    return (probs * weight).sum(dim=(1, 2)) / (hq * weight.sum(dim=(1, 2)).clamp_min(1.0))


def masked_zscore(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """z-normalise each row of x (B, L) over the entries where mask is True; others are returned as 0."""
    m = mask.float()
    n = m.sum(dim=-1, keepdim=True).clamp_min(1.0)
    mean = (x * m).sum(dim=-1, keepdim=True) / n
    var = (((x - mean) * m) ** 2).sum(dim=-1, keepdim=True) / n
    return ((x - mean) / (var.sqrt() + EPS)) * m


# -- baselines (issue #3): attention pooling, R-KV redundancy, KeyDiff, LagKV, ThinKV sparsity ---------


def group_heads(x: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Fold query heads onto the KV heads they share (GQA), by mean or max over each group.

    x: (B, Hq, ...) with Hq a multiple of num_kv_heads; query head h reads KV head h // (Hq / H), the
    layout of transformers' ``repeat_kv``. Returns (B, H, ...).
    """
    if how not in ("mean", "max"):
        raise ValueError(f"how must be 'mean' or 'max', got {how!r}")
    b, hq = x.shape[:2]
    grouped = x.reshape(b, num_kv_heads, hq // num_kv_heads, *x.shape[2:])
    return grouped.mean(dim=2) if how == "mean" else grouped.amax(dim=2)


def pool_slots(x: torch.Tensor, kernel: int, how: str = "avg") -> torch.Tensor:
    """1-D pooling along the slot axis with stride 1 and padding kernel // 2 (SnapKV, R-KV).

    x: (..., L) float; kernel: odd width. ``avg`` divides by the full kernel at the edges (zero
    padding counted, as ``avg_pool1d`` does by default); ``max`` ignores the padding. Returns (..., L).
    """
    if kernel % 2 != 1:
        raise ValueError(f"kernel must be odd, got {kernel}")
    if kernel == 1:
        return x.float()
    flat = x.float().reshape(-1, 1, x.shape[-1])
    if how == "avg":
        out = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif how == "max":
        out = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"how must be 'avg' or 'max', got {how!r}")
    return out.reshape(x.shape)


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy of each cached key (Cai et al. 2025, §3.2; method-and-baselines.md §2.5).

    keys: (B, H, L, D); valid: (B, L) bool (holes take no part). Cosine similarities of L2-normalised
    keys with the diagonal zeroed; in every row i the entry of i's newest near-duplicate (the largest
    slot j with similarity > threshold) is set to 0, so the newest copy of repeated content looks least
    redundant; R_j = mean over rows i of column j, softmax over the valid slots. Returns (B, H, L)
    float32, 0 at holes.
    """
    length = keys.shape[2]
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = k @ k.transpose(-1, -2)
    eye = torch.eye(length, dtype=torch.bool, device=keys.device)
    pair = (valid[:, None, :, None] & valid[:, None, None, :]) & ~eye
    sim = sim.masked_fill(~pair, 0.0)
    slots = torch.arange(length, device=keys.device)
    newest = torch.where(sim > threshold, slots, -1).amax(dim=-1, keepdim=True)  # (B, H, L, 1)
    sim = sim.masked_fill((slots == newest) & (newest >= 0), 0.0)
    rows = valid.sum(dim=-1).clamp_min(1)[:, None, None].float()
    mean = sim.sum(dim=-2) / rows
    return torch.softmax(mean.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)


def keydiff_scores(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KeyDiff (arXiv 2504.15364): minus the cosine similarity of each key to the mean normalised key.

    keys: (B, H, L, D); valid: (B, L) bool, holes are left out of the mean. Returns (B, H, L) float32;
    a distinctive key scores high.
    """
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    m = valid[:, None, :, None].float()
    anchor = (k * m).sum(dim=2, keepdim=True) / m.sum(dim=2, keepdim=True).clamp_min(1.0)
    return -torch.nn.functional.cosine_similarity(k, anchor, dim=-1)


def _chunk_softmax(x: torch.Tensor, chunk: torch.Tensor, n: int, mask: torch.Tensor) -> torch.Tensor:
    """Softmax of x (B, H, L) within groups ``chunk`` (B, H, L) in [0, n), over slots where mask."""
    x = x.masked_fill(~mask, float("-inf"))
    top = torch.full((*x.shape[:2], n), float("-inf"), device=x.device)
    top = top.scatter_reduce(-1, chunk, x, "amax", include_self=True)
    e = torch.exp(x - top.gather(-1, chunk)).masked_fill(~mask, 0.0)
    total = torch.zeros_like(top).scatter_add(-1, chunk, e)
    return e / total.gather(-1, chunk).clamp_min(1e-30)


def _chunk_spread(x: torch.Tensor, chunk: torch.Tensor, n: int, member: torch.Tensor) -> torch.Tensor:
    """Std over D of x (B, H, L, D) min-max normalised per channel by the members of chunk c + 1."""
    idx = chunk[..., None].expand_as(x)
    big = torch.finfo(torch.float32).max
    shape = (*x.shape[:2], n + 1, x.shape[-1])
    lo = torch.full(shape, big, device=x.device).scatter_reduce(
        2, idx, x.masked_fill(~member[..., None], big), "amin"
    )
    hi = torch.full(shape, -big, device=x.device).scatter_reduce(
        2, idx, x.masked_fill(~member[..., None], -big), "amax"
    )
    ref = (chunk + 1)[..., None].expand_as(x)
    mn, mx = lo.gather(2, ref), hi.gather(2, ref)
    return ((x - mn) / (mx - mn + 1e-9)).std(dim=-1)


def lag_chunk_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    seen: torch.Tensor,
    n_sink: int,
    lag: int,
) -> torch.Tensor:
    """Original LagKV scores (Liang et al., arXiv 2504.04704; kvpress ``LagKVPress``), by true position.

    keys, values: (B, H, L, D); positions: (B, H, L) true positions (-1 at holes); valid: (B, L);
    seen: (B,) tokens seen. Positions after the n_sink sinks are cut into chunks of ``lag``; a chunk is
    scored once its successor is complete (n_sink + (c + 2) * lag <= seen), against the min/max per
    head and channel of the successor's cached tokens: per-token std over D of the normalised keys and
    of the values, each softmaxed within the chunk, averaged, then turned into the rank within the chunk
    divided by the chunk's cached count (so a global top-k keeps the same share of every chunk).
    Returns (B, H, L) in [0, 1): sinks and chunks without a complete successor score 1.0.
    """
    pos = positions.long()
    real = valid[:, None, :] & (pos >= n_sink)
    chunk = ((pos - n_sink).clamp_min(0) // lag).masked_fill(~real, 0)
    n = int(seen.max()) // lag + 2  # one host sync per compaction
    scorable = real & ((chunk + 2) * lag + n_sink <= seen[:, None, None])
    member = real & (chunk >= 1)  # cached tokens that can act as a reference
    score_k = _chunk_softmax(_chunk_spread(keys.float(), chunk, n, member), chunk, n, scorable)
    score_v = _chunk_softmax(_chunk_spread(values.float(), chunk, n, member), chunk, n, scorable)
    combined = ((score_k + score_v) / 2).masked_fill(~scorable, 0.0)
    # Rank within the chunk: sort by (chunk, score); non-scorable slots sort last.
    key = torch.where(scorable, chunk.float() * 4 + combined, torch.full_like(combined, float("inf")))
    order = key.argsort(dim=-1, stable=True)
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    count = torch.zeros(*chunk.shape[:2], n, device=chunk.device).scatter_add(-1, chunk, scorable.float())
    before = count.cumsum(dim=-1) - count
    within = rank.float() - before.gather(-1, chunk)
    out = within / count.gather(-1, chunk).clamp_min(1.0)
    return torch.where(scorable, out, torch.ones_like(out))


def attention_sparsity(rows: torch.Tensor, threshold: float) -> torch.Tensor:
    """Share of a query row's attention weights below ``threshold`` x the row max (ThinKV's sparsity).

    rows: (..., L) attention weights; only positive weights count as slots (holes and masked slots are
    exactly 0 in both attention modes). Returns (...) float32 in [0, 1].
    """
    r = rows.float()
    present = r > 0
    small = present & (r < threshold * r.amax(dim=-1, keepdim=True))
    return small.sum(dim=-1).float() / present.sum(dim=-1).clamp_min(1).float()
