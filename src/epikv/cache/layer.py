"""One decoder layer's view of the KV arena, in transformers' cache-layer contract.

A :class:`BudgetedLayer` owns no storage: its keys and values are the layer's tensors in the
cache's :class:`~epikv.cache.arena.Arena`, and :meth:`update` writes a step's new keys and values
at the slots the cache chose for them (:class:`~epikv.cache.arena.Writes`) and returns views of the
live rectangle — nothing is concatenated. The cache owns rows, slots and positions; the layer only
writes and reads.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from epikv.cache.arena import Arena, Writes


class ArenaViewLayer(CacheLayerMixin):
    """What every layer over arena storage shares: no storage of its own, nothing to initialise, and
    none of the row verbs transformers' generate may call."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the cache allocates the storage before the first write."""

    # The row verbs transformers' generate may call would move keys without their positions, books and
    # policy state: the cache's own row operations (keep_rows, append) are the only way rows move.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("beam search is not supported with a budgeted cache (its rows evict independently)")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a budgeted cache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("a budgeted cache cannot repeat rows (use one row per sequence)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("a budgeted cache keeps rows through BudgetedCache.keep_rows only")


class BudgetedLayer(ArenaViewLayer):
    """Keys and values of one layer: views of the arena (rows x width), written in place."""

    def __init__(self, arena: Arena, index: int) -> None:  # no super().__init__: keys are views
        self.arena, self.index = arena, index
        self.rows = self.width = 0
        self.pending: int | None = None  # the width after a step that writes into freed slots
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor | None:
        if not self.arena.allocated:
            return None
        return self.arena.keys[self.index][: self.rows, :, : self.width]

    @property
    def values(self) -> torch.Tensor | None:
        if not self.arena.allocated:
            return None
        return self.arena.values[self.index][: self.rows, :, : self.width]

    @property
    def positions(self) -> torch.Tensor | None:
        """True positions of the live slots, (rows, Hp, width) int32; -1 at holes."""
        if not self.arena.allocated:
            return None
        return self.arena.positions[self.index, : self.rows, :, : self.width]

    @property
    def device(self) -> torch.device | None:
        return self.arena.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        writes: Writes = kwargs["writes"]
        keys, values = self.arena.keys[self.index], self.arena.values[self.index]
        if writes.heads is not None:  # one slot per row, layer group and head (rank_every)
            group = writes.heads[self.index if writes.heads.shape[0] > 1 else 0].long()
            slots = group.expand(-1, keys.shape[1])  # (rows, H)
            heads = torch.arange(keys.shape[1], device=keys.device)[None, :]
            keys[writes.row_ids[:, None], heads, slots] = key_states[:, :, 0]
            values[writes.row_ids[:, None], heads, slots] = value_states[:, :, 0]
        elif writes.index is None:
            end = writes.start + key_states.shape[2]
            keys[: writes.rows, :, writes.start : end] = key_states
            values[: writes.rows, :, writes.start : end] = value_states
        else:
            keys[writes.row_ids, :, writes.index] = key_states[:, :, 0]
            values[writes.row_ids, :, writes.index] = value_states[:, :, 0]
        self.rows, self.width, self.pending = writes.rows, writes.width, None
        return keys[: writes.rows, :, : writes.width], values[: writes.rows, :, : writes.width]

    def resize(self, rows: int, width: int) -> None:
        self.rows, self.width = rows, width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.width + query_length if self.pending is None else self.pending), 0

    def get_seq_length(self) -> int:
        return self.width

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.rows = self.width = 0
