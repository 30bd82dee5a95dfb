"""A cache layer that keeps the true position of every slot, and the slot-level row operations
(compact, rewrite some rows in place, take rows, append rows) the budgeted cache is built from."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import pad
from transformers.cache_utils import DynamicLayer

from epikv.selection import gather_slots, gather_tokens


class BudgetedLayer(DynamicLayer):
    """A growing cache layer that also records the true position of every slot, (B, Hp, L) int32,
    where Hp is 1 unless the policy selects per head (then heads hold different tokens)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        positions = kwargs.pop("positions", None)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if positions is not None:
            new = positions[:, None, :]
            if self.positions is not None:
                new = torch.cat([self.positions, new.expand(-1, self.positions.shape[1], -1)], dim=-1)
            self.positions = new
        return keys, values

    def compact(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the slots ``index`` (B, 1 or H, k); ``valid`` (B, k) marks holes as False."""
        self.keys = gather_slots(self.keys, index)
        self.values = gather_slots(self.values, index)
        pos = self.positions.expand(-1, index.shape[1], -1).gather(-1, index.to(torch.long))
        self.positions = pos.masked_fill(~valid[:, None, :], -1)

    def rewrite_rows(self, rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows ``rows`` keep slots ``index`` (b, 1 or H, k), written at the end of their rows in place
        (holes before them); ``valid`` (b, k). Other rows are not touched."""
        length, k = self.keys.shape[2], index.shape[-1]
        self.keys[rows, :, length - k :] = gather_slots(self.keys[rows], index)
        self.values[rows, :, length - k :] = gather_slots(self.values[rows], index)
        pos = self.positions[rows].expand(-1, index.shape[1], -1).gather(-1, index.to(torch.long))
        if pos.shape[1] != self.positions.shape[1]:  # per-head selection of a layer that held one row
            self.positions = self.positions.expand(-1, pos.shape[1], -1).clone()
        self.positions[rows] = pad(pos.masked_fill(~valid[:, None, :], -1), (length - k, 0), value=-1)

    # -- rows (continuous batching) -------------------------------------------------------------
    def take_rows(self, index: torch.Tensor | None, trim: int) -> None:
        """Keep rows ``index`` (all if None) and drop the first ``trim`` slots (holes in every row)."""
        pick = slice(None) if index is None else index
        self.keys = self.keys[pick, :, trim:]
        self.values = self.values[pick, :, trim:]
        self.positions = self.positions[pick, :, trim:]

    def append_rows(self, other: BudgetedLayer) -> None:
        """Add ``other``'s rows after these, left-padding the shorter side with holes."""
        length = max(self.keys.shape[2], other.keys.shape[2])
        parts = [left_pad_layer(layer, length) for layer in (self, other)]
        self.keys = torch.cat([p[0] for p in parts])
        self.values = torch.cat([p[1] for p in parts])
        # A row that compacted per head carries a position per head; one that did not, one for all.
        heads = max(p[2].shape[1] for p in parts)
        self.positions = torch.cat([p[2].expand(-1, heads, -1) for p in parts])

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("beam search is not supported with a budgeted cache (its rows evict independently)")


def rewrite_token_rows(buf: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A per-token buffer (G, B, H, L) whose rows ``rows`` keep slots ``index`` (G', b, H', k) at their
    end (zeros before them); G and H broadcast, so the buffer may come back wider."""
    kept = gather_tokens(buf.index_select(1, rows), index)
    g, h = max(buf.shape[0], kept.shape[0]), max(buf.shape[2], kept.shape[2])
    out = buf.expand(g, -1, h, -1).clone() if (g, h) != (buf.shape[0], buf.shape[2]) else buf
    out[:, rows] = pad(kept, (buf.shape[-1] - kept.shape[-1], 0))
    return out


def left_pad_layer(layer: BudgetedLayer, length: int) -> tuple[torch.Tensor, ...]:
    n = length - layer.keys.shape[2]
    if n == 0:
        return layer.keys, layer.values, layer.positions
    return (
        pad(layer.keys, (0, 0, n, 0)),
        pad(layer.values, (0, 0, n, 0)),
        pad(layer.positions, (n, 0), value=-1),
    )


def left_pad(x: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    """Left-pad the last dim of x to ``length`` with ``value`` (holes at the front, as padding)."""
    return pad(x, (length - x.shape[-1], 0), value=value)
