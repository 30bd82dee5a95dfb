"""The KV arena: every tensor a budgeted cache keeps per slot, preallocated once and written in place.

Storage is a rectangle of ``rows`` x ``slots`` per tensor: keys and values per layer (rows, H, slots,
D), true positions for every layer (layers, rows, Hp, slots), which slots are real (rows, slots) and
the policy's per-token buffers (G, rows, Hb, slots). A row's slots are *left-aligned*: its tokens
fill slots 0..fill-1 in positional order and a decode step writes the next token at slot ``fill`` of
its own row, so nothing moves when tokens arrive; a compaction moves the kept slots to the front of
their row in place. The rectangle only grows (by a copy, when a row or a slot more is needed than it
holds), and the owner can cap it (a KV pool), so the bytes allocated are known up front.

A *row view* (:meth:`Arena.row_view`) is an arena over one row of another: a request is prefilled
straight into the row it will decode in, so admitting it copies nothing.

It is the one place slots and rows are written and moved (a step's new tokens, a compaction's kept
slots, rows kept or appended — for the global layers and the sliding windows' rings alike), and it
knows nothing of policies, budgets or models: only shapes, dtypes, slots and the gathers that move
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epikv.selection import gather_slots, gather_tokens

MIN_SLOTS = 64  # slots an arena without a reservation starts with; it then doubles as it fills


@dataclass(frozen=True)
class ArenaShape:
    """What one arena holds per slot: layers, KV heads and head dim; ``position_heads`` is 1 unless
    the policy keeps a different set of tokens per head (then positions are kept per head), and
    ``buffer_layers`` / ``buffer_heads`` the widest (G, H) layout of the policy's per-token buffers."""

    layers: int
    kv_heads: int
    head_dim: int
    position_heads: int = 1
    buffer_layers: int = 1
    buffer_heads: int = 1


@dataclass(frozen=True)
class Writes:
    """Where a step's q new tokens go: slots ``start``..``start+q-1`` of rows 0..rows-1 when every
    row is at the same fill (``index`` None), else slot ``index[r]`` of row r (q = 1), or, when
    ``heads`` (G, rows, H) is set (q = 1), slot ``heads[g, r, h]`` in each layer group g and KV head
    h (G and H are 1 or the arena's per-group / per-head widths: a slot freed in place by a per-head
    policy differs by head); ``width`` is the live rectangle's width after the step, ``before`` its
    width before (None: ``width - q``; a row writing into a freed slot does not widen it)."""

    rows: int
    width: int
    q: int
    start: int = 0
    index: torch.Tensor | None = None
    row_ids: torch.Tensor | None = None
    heads: torch.Tensor | None = None
    before: int | None = None

    def slots(self) -> torch.Tensor:
        """(rows, q) slot of each new token, or (G, rows, H) when they differ by group and head."""
        if self.heads is not None:
            return self.heads
        if self.index is not None:
            return self.index[:, None]
        return (self.start + torch.arange(self.q)).expand(self.rows, self.q)

    def head_slots(self, groups: int, heads: int) -> torch.Tensor:
        """``heads`` as (groups, rows, heads, 1) int64, for a scatter into a table that wide."""
        assert self.heads is not None
        return self.heads.long().expand(groups, -1, heads)[..., None]


class Arena:
    """Preallocated per-slot storage for ``rows`` x ``slots`` (see the module docstring)."""

    def __init__(
        self,
        shape: ArenaShape,
        dtype: torch.dtype,
        device: torch.device,
        max_slots: int | None = None,
        row_overhead: int = 0,
    ) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.max_slots = max_slots  # rows x (slots + row_overhead) never exceeds this (None = no cap)
        self.row_overhead = row_overhead  # slots each row holds elsewhere, counted in the cap
        self.rows = self.slots = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions = torch.zeros(0, dtype=torch.int32)
        self.valid = torch.zeros(0, dtype=torch.bool)
        self.buffers: dict[str, torch.Tensor] = {}
        self._parent: Arena | None = None
        self._row = 0

    # -- allocation --------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def kv_bytes(self) -> int:
        """Bytes of keys and values allocated (every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def ensure(self, rows: int, slots: int, keep_rows: int, keep_slots: int, exact: bool = False) -> None:
        """Make room for ``rows`` x ``slots``, keeping the first ``keep_rows`` rows' first ``keep_slots``
        slots. Growing copies; an arena that already holds the room is left as it is. Rows double
        unless ``exact``."""
        if rows <= self.rows and slots <= self.slots:
            return
        if self._parent is not None:
            raise RuntimeError(f"a row view holds {self.slots} slots and cannot grow to {slots}")
        extra = self.row_overhead
        if self.max_slots is not None and rows * (slots + extra) > self.max_slots:
            raise MemoryError(
                f"the KV arena would need {rows} rows x {slots + extra} slots = {rows * (slots + extra)}, "
                f"over its cap of {self.max_slots} slots"
            )
        # Rows double (admissions then copy the arena O(log n) times); slots are what the caller asks.
        new_rows = self.rows if rows <= self.rows else (rows if exact else max(rows, 2 * self.rows))
        new_slots = max(slots, self.slots)
        if self.max_slots is not None and new_rows * (new_slots + extra) > self.max_slots:
            new_slots = slots  # drop room no live row needs rather than pass the cap
            new_rows = max(rows, min(new_rows, self.max_slots // (new_slots + extra)))
        s = self.shape
        old = (self.keys, self.values, self.positions, self.valid, self.buffers)
        kv = (new_rows, s.kv_heads, new_slots, s.head_dim)
        self.keys = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in range(s.layers)]
        self.values = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in range(s.layers)]
        self.positions = torch.full(
            (s.layers, new_rows, s.position_heads, new_slots), -1, dtype=torch.int32, device=self.device
        )
        self.valid = torch.zeros(new_rows, new_slots, dtype=torch.bool, device=self.device)
        self.buffers = {
            name: buf.new_zeros(buf.shape[0], new_rows, buf.shape[2], new_slots)
            for name, buf in old[4].items()
        }
        self.rows, self.slots = new_rows, new_slots
        r, n = keep_rows, keep_slots
        if r and n:
            for new, prev in zip((*self.keys, *self.values), (*old[0], *old[1]), strict=True):
                new[:r, :, :n] = prev[:r, :, :n]
            self.positions[:, :r, :, :n] = old[2][:, :r, :, :n]
            self.valid[:r, :n] = old[3][:r, :n]
            for name, buf in old[4].items():
                self.buffers[name][:, :r, :, :n] = buf[:, :r, :, :n]

    def slots_for(self, need: int, reserved: Sequence[int | None]) -> int:
        """Slots to hold ``need``: more slots double (amortised: O(log n) copies as rows grow), never past
        the widest reservation when every row has one (a full cache's prompt + max_new_tokens, or an
        evicting row's K + tau), so the arena is at most the rectangle the scheduler admitted."""
        if need <= self.slots:
            return self.slots
        grown = max(need, 2 * self.slots, MIN_SLOTS)
        if reserved and all(r is not None for r in reserved):
            grown = min(grown, max(r for r in reserved if r is not None))
        return max(need, grown)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The per-token buffer ``name``, made (zeros) on first use at the widest (G, H) layout."""
        buf = self.buffers.get(name)
        if buf is not None:
            return buf
        if self._parent is not None:
            self.buffers[name] = self._parent.buffer(name, like)[:, self._row : self._row + 1]
            return self.buffers[name]
        s = self.shape
        g, h = max(like.shape[0], s.buffer_layers), max(like.shape[2], s.buffer_heads)
        self.buffers[name] = torch.zeros(g, self.rows, h, self.slots, dtype=like.dtype, device=self.device)
        return self.buffers[name]

    def row_view(self, row: int) -> Arena:
        """An arena over row ``row`` of this one (same storage): writes to it land in that row."""
        view = Arena(self.shape, self.dtype, self.device)
        view._parent, view._row = self, row
        view.rows, view.slots = 1, self.slots
        view.keys = [k[row : row + 1] for k in self.keys]
        view.values = [v[row : row + 1] for v in self.values]
        view.positions = self.positions[:, row : row + 1]
        view.valid = self.valid[row : row + 1]
        view.buffers = {name: buf[:, row : row + 1] for name, buf in self.buffers.items()}
        return view

    def is_view_of(self, other: Arena, row: int) -> bool:
        """Whether this arena is row ``row`` of ``other``, on its current storage (a view taken
        before ``other`` grew reads the old storage)."""
        if self._parent is not other or self._row != row:
            return False
        return self.valid.untyped_storage().data_ptr() == other.valid.untyped_storage().data_ptr()

    # -- a step's writes -------------------------------------------------------------------------
    def write_tokens(self, writes: Writes, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """The true positions (rows, q) int32 (-1 at pads) and validity (rows, q) of a step's new tokens."""
        if writes.heads is not None:
            table = self.positions[:, : writes.rows]
            index = writes.head_slots(table.shape[0], table.shape[2])
            table.scatter_(-1, index, positions[None, :, None, :].expand_as(index).to(table.dtype))
            self.valid[writes.row_ids, writes.heads[0, :, 0]] = valid[:, 0]  # one slot per row is enough:
            # a slot freed in place stays valid (its row holds a token there again after this write)
        elif writes.index is None:
            new = slice(writes.start, writes.start + writes.q)
            self.positions[:, : writes.rows, :, new] = positions[None, :, None, :]
            self.valid[: writes.rows, new] = valid
        else:
            self.positions[:, writes.row_ids, :, writes.index] = positions[:, 0, None, None]
            self.valid[writes.row_ids, writes.index] = valid[:, 0]

    def write_values(self, name: str, value: torch.Tensor, writes: Writes) -> None:
        """A policy's per-token values (G, rows, H, n) into buffer ``name``: every live slot (n = the
        step's width) or the step's new tokens (n = q)."""
        buf, rows, q = self.buffer(name, value), writes.rows, writes.q
        if value.shape[-1] == writes.width:
            buf[:, :rows, :, : writes.width] = value
        elif value.shape[-1] != q:
            raise ValueError(f"policy buffer {name!r} has {value.shape[-1]} slots, not {q} or {writes.width}")
        elif writes.heads is not None:
            table = buf[:, :rows]
            index = writes.head_slots(table.shape[0], table.shape[2])
            table.scatter_(-1, index, value.expand(table.shape[0], -1, table.shape[2], -1).to(table.dtype))
        elif writes.index is None:
            buf[:, :rows, :, writes.start : writes.start + q] = value
        else:
            buf[:, writes.row_ids, :, writes.index] = value[..., 0].transpose(0, 1)

    def free_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Evict in place: slot ``slots[g, i, h]`` (G, b, H) of row ``rows[i]`` in each layer group g
        and head h holds nothing from now on (true position -1, per-token values 0); it stays valid,
        for the row's next token is written there (:class:`Writes` ``heads``) before anything reads it."""
        for table in (self.positions, *self.buffers.values()):
            part = table[:, rows]
            index = slots.long().expand(part.shape[0], -1, part.shape[2])[..., None]
            table[:, rows] = part.scatter(-1, index, -1 if table is self.positions else 0)

    def freed_slots(self, rows: int, width: int, groups: int) -> torch.Tensor:
        """(groups, rows, Hp) the slot each of the first ``rows`` rows freed in place in each layer
        group and head (valid, position -1: one at most per group and head; 0 where none is freed)."""
        positions = self.positions[:groups, :rows, :, :width]
        return (self.valid[None, :rows, None, :width] & (positions < 0)).int().argmax(dim=-1)

    # -- moving rows and slots ------------------------------------------------------------------
    def clear_rows(self, rows: torch.Tensor | slice, start: int | torch.Tensor, end: int) -> None:
        """Mark slots start..end-1 of ``rows`` as holes (``start`` per row, (b,), or one for all)."""
        if isinstance(start, int):
            self.valid[rows, start:end] = False
            self.positions[:, rows, :, start:end] = -1
            for buf in self.buffers.values():
                buf[:, rows, :, start:end] = 0
            return
        slots = torch.arange(end, device=self.valid.device)
        hole = slots[None, :] >= start[:, None]  # (b, end)
        self.valid[rows, :end] &= ~hole
        self.positions[:, rows, :, :end] = self.positions[:, rows, :, :end].masked_fill(
            hole[None, :, None], -1
        )
        for buf in self.buffers.values():
            buf[:, rows, :, :end] = buf[:, rows, :, :end].masked_fill(hole[None, :, None], 0)

    def copy_rows(
        self, dst: torch.Tensor, src: torch.Tensor, slots: int, source: Arena | None = None
    ) -> None:
        """Rows ``src`` of ``source`` (default: this arena) written to rows ``dst``, first ``slots`` slots."""
        source = source or self
        for mine, theirs in zip((*self.keys, *self.values), (*source.keys, *source.values), strict=True):
            mine[dst, :, :slots] = theirs[src, :, :slots]
        self.positions[:, dst, :, :slots] = source.positions[:, src, :, :slots]
        self.valid[dst, :slots] = source.valid[src, :slots]
        for name, buf in source.buffers.items():
            self.buffer(name, buf)[:, dst, :, :slots] = buf[:, src, :, :slots]

    def keep_rows(self, index: Sequence[int], rows: int, slots: int) -> None:
        """Of the first ``rows`` rows keep rows ``index``, in that order, as rows 0..len(index)-1 (first
        ``slots`` slots); only rows that change place are copied, and the rows after them become holes."""
        moves = [(dst, src) for dst, src in enumerate(index) if dst != src]
        if moves:
            device = self.valid.device
            dst = torch.tensor([m[0] for m in moves], device=device)
            src = torch.tensor([m[1] for m in moves], device=device)
            self.copy_rows(dst, src, slots)
        if len(index) < rows:
            self.clear_rows(slice(len(index), rows), 0, slots)

    def append_rows(self, source: Arena, rows: int, at: int, slots: int) -> None:
        """The first ``rows`` rows of ``source`` written at rows ``at``.. (first ``slots`` slots), unless
        ``source`` is a row view of this arena at ``at`` (a request prefilled in place: nothing moves).
        The caller has made room."""
        if source.is_view_of(self, at):
            return
        device = self.valid.device
        dst = torch.arange(at, at + rows, device=device)
        self.copy_rows(dst, torch.arange(rows, device=device), slots, source=source)

    def keep_slots(
        self,
        rows: torch.Tensor | slice,
        index: torch.Tensor,
        valid: torch.Tensor,
        kept: torch.Tensor,
        width: int,
    ) -> None:
        """A compaction: rows ``rows`` keep slots ``index`` (G, b, H, k) of their first ``width``, written
        at the front of each row in place (``valid`` (b, k) marks the kept ones, ``kept`` (b,) counts
        them); every slot after a row's kept ones becomes a hole."""
        k, grouped = index.shape[-1], index.shape[0] > 1
        for layer in range(self.shape.layers):
            idx = index[layer if grouped else 0]
            for store in (self.keys[layer], self.values[layer]):
                store[rows, :, :k] = gather_slots(store[rows, :, :width], idx)
        self.positions[:, rows, :, :k] = gather_tokens(self.positions[:, rows, :, :width], index)
        for buf in self.buffers.values():
            buf[:, rows, :, :k] = gather_tokens(buf[:, rows, :, :width], index)
        self.valid[rows, :k] = valid
        self.clear_rows(rows, kept, width)
