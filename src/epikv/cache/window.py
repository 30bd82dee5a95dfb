"""Sliding-window layers' keys and values: a ring of W slots per row, never evicted by a policy.

A model that interleaves sliding-window layers with global ones (Gemma 3, OLMo-3, gpt-oss, EXAONE 4)
already bounds those layers by their window W: a query at position p attends the keys at p-W+1..p.
So the budgeted cache evicts in the global layers only and leaves each window to the model. A row's
token at position p goes to ring slot p mod W of every sliding layer, in place, overwriting the
token at p-W, which has just left the window; slot W takes what must not be kept (padding, and a
prompt's tokens older than its last W), and is never attended. A decode step therefore attends the
whole ring (W+1 slots, a fixed size whatever the length); a pass of several tokens (a prompt, or a
chunk of one) attends the ring as it was plus its own tokens, and its mask says which are in each
query's window, by true position. Ring slots hold tokens out of positional order, which attention
does not see: the mask is built from the positions, never from slot order.

Storage is an :class:`~epikv.cache.arena.Arena` (one layer per sliding layer, W+1 slots), so rows
are kept, appended and viewed by the same arena verbs as the global layers' rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from epikv.cache.arena import Arena, ArenaShape
from epikv.cache.layer import ArenaViewLayer


class Windows:
    """The rings of every sliding layer of one cache, and the slots of the current pass."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        window: int,
        dtype: torch.dtype,
        device: torch.device,
        arena: Arena | None = None,
        follow: Arena | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"a sliding window must hold at least one token, got {window}")
        self.window = window
        self.arena = arena or Arena(ArenaShape(layers, kv_heads, head_dim), dtype, device)
        self.follow = follow  # the global layers' arena, whose row count the rings keep (never more)
        self.rows = 0
        self.joined = False  # this pass attends the ring as it was, then its own tokens
        self.fresh = True  # nothing in the rings yet (a first prefill attends its own tokens only)
        self.row_ids = torch.zeros(0, dtype=torch.long)
        self.index = torch.zeros(0, 0, dtype=torch.long)
        self.key_positions = torch.zeros(0, 0, dtype=torch.long)  # (B, Lk) of this pass's keys
        self.key_valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def slots(self) -> int:
        return self.window + 1

    def ensure(self, rows: int, keep_rows: int) -> None:
        """Rings for ``rows`` rows: as many as the global arena has, so a KV pool that caps it (with
        the rings' cost as its row overhead) bounds the rings too."""
        target = max(rows, self.follow.rows) if self.follow is not None else rows
        self.arena.ensure(target, self.slots, keep_rows, self.slots, exact=True)

    def begin_step(self, new_valid: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor) -> None:
        """Choose the ring slot of each new token (B, q) at true ``positions``; ``seen`` (B,) is each
        row's token count after this pass. Records the keys this pass attends and their positions."""
        batch, q = new_valid.shape
        self.ensure(batch, self.rows)
        arena, window = self.arena, self.window
        keep = new_valid & (positions >= (seen[:, None] - window))
        self.index = torch.where(keep, positions % window, torch.full_like(positions, window))
        self.row_ids = torch.arange(batch, device=positions.device)
        self.joined = q > 1
        if self.joined:  # the ring as it was (copied before the writes below), then the new tokens
            new_pos = positions.masked_fill(~new_valid, -1)
            if self.fresh:
                self.key_positions, self.key_valid = new_pos, new_valid
            else:
                self.key_positions = torch.cat([arena.positions[0, :batch, 0].long(), new_pos], dim=-1)
                self.key_valid = torch.cat([arena.valid[:batch], new_valid], dim=-1)
        rows = self.row_ids[:, None]
        arena.positions[:, rows, 0, self.index] = positions.to(torch.int32)[None]
        arena.valid[rows, self.index] = keep  # the spare slot W only ever takes keep=False
        if not self.joined:
            self.key_positions, self.key_valid = arena.positions[0, :batch, 0].long(), arena.valid[:batch]
        self.rows = batch

    def end_step(self) -> None:
        self.fresh = False

    def mask_function(self, query_positions: torch.Tensor):
        """transformers' index-based mask function for this pass's sliding layers: key k is seen by query
        i when it is real, not after it, and inside its window (by true position)."""
        keys, valid, window = self.key_positions, self.key_valid, self.window

        def allowed(b: Any, h: Any, qi: Any, ki: Any) -> torch.Tensor:
            k, p = keys[b, ki], query_positions[b, qi]
            return valid[b, ki] & (k <= p) & (k > p - window)

        return allowed

    # -- rows (the arena moves them; the cache calls these beside its own) ---------------------
    def keep_rows(self, index: Sequence[int]) -> None:
        """Keep only rings ``index``, in that order (see :meth:`Arena.keep_rows`)."""
        self.arena.keep_rows(index, self.rows, self.slots)
        self.rows = len(index)

    def append(self, other: Windows) -> None:
        """Join the rings of ``other`` (prefilled) after these."""
        b, m = self.rows, other.rows
        self.ensure(b + m, b)
        self.arena.append_rows(other.arena, m, b, self.slots)
        self.rows, self.fresh = b + m, False

    def row_view(self, row: int) -> Windows:
        self.ensure(row + 1, self.rows)
        self.arena.clear_rows(slice(row, row + 1), 0, self.slots)
        s = self.arena.shape
        return Windows(
            s.layers,
            s.kv_heads,
            s.head_dim,
            self.window,
            self.arena.dtype,
            self.arena.device,
            arena=self.arena.row_view(row),
        )

    def reset(self) -> None:
        if self.arena.allocated and self.rows:
            self.arena.clear_rows(slice(0, self.rows), 0, self.slots)
        self.rows, self.fresh = 0, True


class WindowLayer(ArenaViewLayer):
    """One sliding-window layer's keys and values: views of its ring, written in place."""

    is_sliding = True

    def __init__(self, windows: Windows, index: int) -> None:  # no super().__init__: keys are views
        self.windows, self.index = windows, index
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor | None:
        w = self.windows
        return w.arena.keys[self.index][: w.rows] if w.arena.allocated else None

    @property
    def values(self) -> torch.Tensor | None:
        w = self.windows
        return w.arena.values[self.index][: w.rows] if w.arena.allocated else None

    @property
    def device(self) -> torch.device | None:
        return self.windows.arena.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        w = self.windows
        keys, values = w.arena.keys[self.index], w.arena.values[self.index]
        rows = w.row_ids[:, None]
        if w.joined:  # a prompt pass attends the ring as it was, then its own tokens
            if w.fresh:
                out = key_states, value_states
            else:
                out = (
                    torch.cat([keys[: w.rows], key_states], dim=2),
                    torch.cat([values[: w.rows], value_states], dim=2),
                )
            keys[rows, :, w.index] = key_states.transpose(1, 2)
            values[rows, :, w.index] = value_states.transpose(1, 2)
            return out
        keys[rows, :, w.index] = key_states.transpose(1, 2)
        values[rows, :, w.index] = value_states.transpose(1, 2)
        return keys[: w.rows], values[: w.rows]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.windows.slots, 0

    def get_seq_length(self) -> int:
        return self.windows.slots

    def get_max_length(self) -> int:
        return self.windows.window

    def reset(self) -> None:
        """The cache resets the rings (one owner)."""


def windows_for(model: Any, arena: Arena) -> Windows | None:
    """The rings for ``model``'s sliding layers (a ModelInfo) beside the global layers' ``arena``, or
    None when it has none."""
    if not model.sliding_layers:
        return None
    shape = (len(model.sliding_layers), model.num_kv_heads, model.head_dim, model.window)
    return Windows(*shape, arena.dtype, arena.device, follow=arena)
