"""The one selection function: scores in, kept slot indices out, for every policy.

Protected slots (prompt or sinks, recent window, a policy's forced keeps) are +inf, slots a policy
must drop are -inf, the rest compete by score. Kept indices come back sorted by slot, i.e. by
position, so a gather keeps positional order (a peer library loses it by gathering unsorted top-k
indices). Rows of a batch may keep different counts (different prompt lengths, capped policies): a
row that keeps fewer slots than the widest row gets masked "holes" at the end, so its kept slots
land at the front of its row (the cache's left-aligned layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Selection:
    """Result of :func:`select_keep`.

    index: (G, B, H, k) slot indices to gather (holes come last and point at the last slot); valid:
    (B, k) bool, False at holes; kept: (B,) number of real slots kept per row.
    """

    index: torch.Tensor
    valid: torch.Tensor
    kept: torch.Tensor


def protected_slots(
    positions: torch.Tensor,
    prompt_len: torch.Tensor,
    seen: torch.Tensor,
    *,
    protect_prompt: bool,
    n_sink: int,
    recent: int | torch.Tensor,
) -> torch.Tensor:
    """Slots no policy may evict: the prompt (or the first n_sink positions) and the last ``recent``.

    positions: (G, B, H, L) true positions (negative at holes); prompt_len, seen: (B,) real prompt
    tokens and real tokens seen per row; recent: one window for every row, or (B,) per row.
    Returns a (G, B, H, L) bool tensor.
    """
    p = positions.long()
    prot = p < n_sink
    if protect_prompt:
        prot = prot | (p < prompt_len[None, :, None, None])
    # A window of 0 protects nothing: seen - 0 is past every cached position.
    prot = prot | (p >= (seen - recent)[None, :, None, None])
    return prot & (p >= 0)


def select_keep(
    scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor
) -> Selection:
    """Top-k per row with protected slots first, returning sorted indices.

    scores: (G, B, H, L) float, +inf = must keep, -inf = must drop; protected: bool broadcastable
    to scores (usually (B, L) or (G, B, H, L)); valid: (B, L) bool, False at holes (never kept);
    keep: (B,) how many real slots each row may keep (its budget, or fewer when the row is short).
    A row keeps min(keep, slots that are not -inf) in every layer group and head; ties keep the
    newer slot.
    """
    if scores.dim() != 4:
        raise ValueError(f"scores must be (G, B, H, L), got shape {tuple(scores.shape)}")
    prot = protected if protected.dim() == 4 else protected[None, :, None, :]
    s = scores.float().masked_fill(prot, float("inf"))
    s = s.masked_fill(~valid[None, :, None, :], float("-inf"))
    allowed = (s > float("-inf")).sum(dim=-1)  # (G, B, H)
    kept = torch.minimum(keep.to(allowed.device), allowed.amin(dim=(0, 2)))
    k_max = int(kept.max())  # one host sync per compaction, never per token
    # Best first; among equal scores the newer slot wins (stable sort over the reversed slots).
    length = s.shape[-1]
    top = length - 1 - s.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k_max]
    rank = torch.arange(k_max, device=s.device)
    real = rank[None, None, None, :] < kept[None, :, None, None]
    ordered = torch.where(real, top, torch.full_like(top, length)).sort(dim=-1).values
    index = ordered.clamp_max(length - 1)
    new_valid = rank[None, :] < kept[:, None]
    return Selection(index=index, valid=new_valid, kept=kept)


def gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather slots along dim -2 of x (B, H, L, D) with index (B, H or 1, k); returns (B, H, k, D).

    When each slot's D values are contiguous (a cache's storage, or a view of its first slots), the
    slots are copied as whole rows of a 2-D view of the storage (``index_select``), an order of
    magnitude faster on CPU than ``gather``, which indexes every element; same values either way."""
    b, h, _, d = x.shape
    idx = index.expand(b, h, -1)
    s_b, s_h, s_l, s_d = x.stride()
    if s_d != 1 or s_l != d or s_h % d or s_b % d or x.storage_offset() % d or x.numel() == 0:
        return x.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, d))
    start = torch.arange(b, device=x.device)[:, None, None] * (s_b // d)
    start = start + torch.arange(h, device=x.device)[None, :, None] * (s_h // d)
    rows = (b - 1) * (s_b // d) + (h - 1) * (s_h // d) + x.shape[2]
    flat = x.as_strided((rows, d), (d, 1))
    return flat.index_select(0, (start + idx).reshape(-1)).view(b, h, -1, d)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather slots along the last dim of x (G, B, H, L) with index (G', B, H', k), broadcasting G and H."""
    g = max(x.shape[0], index.shape[0])
    h = max(x.shape[2], index.shape[2])
    return x.expand(g, -1, h, -1).gather(-1, index.expand(g, -1, h, -1))
