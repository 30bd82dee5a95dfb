"""Keys and values in a paged KV cache, read and moved through the backend's own page layout.

A paged cache keeps each layer as ``[num_blocks, H, B, 2D]`` pages (one page per block and KV head)
inside one backing allocation. Where inside its page a token's key or value sits is the attention
backend's business: vLLM's CPU backend stores a block's keys column-major (``[D, B]``) for its
``vec`` kernels and packed for AMX. So nothing here assumes a layout: :func:`probe_layout` writes
probe tokens through the backend's own writer into a scratch page and reads back where each
(token, dim) landed, and every read and move goes through those offsets.

Physical slot ``s`` of a request is token ``s % B`` of block ``block_ids[s // B]``; a *global slot*
is ``block_id * B + s % B`` (one number per token slot of the pool, what vLLM's slot mapping holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# key (T, H, D), value (T, H, D), key pages (N, H, B, D), value pages (N, H, B, D), slots (T,)
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
_DIGIT = 64  # probe values stay below this: exact in fp16 and bf16


@dataclass(frozen=True)
class PageLayout:
    """Element offsets, inside one (block, head) page of ``2 * B * D`` elements, of token t's dim d:
    ``key[t, d]`` and ``value[t, d]``, each (B, D) int64."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.key.shape[0]

    @property
    def both(self) -> torch.Tensor:
        """(B, 2D): a token's key offsets, then its value offsets (what a move copies)."""
        return torch.cat([self.key, self.value], dim=1)


def probe_layout(write: Writer, block_size: int, head_dim: int, dtype: torch.dtype) -> PageLayout:
    """Where the backend's writer puts each (token, dim) of a page, found by writing probes.

    Four writes into a scratch page of one block and one head: the token index and the dim index,
    each as two base-64 digits, so every probe value is exact in bf16. Raises if the writer does not
    put every (token, dim) of the key and the value at its own element of the page."""
    b, d = block_size, head_dim
    offsets = {}
    for part in ("key", "value"):
        found = []
        for kind in ("token", "dim"):
            index = torch.arange(b)[:, None].expand(b, d) if kind == "token" else torch.arange(d).expand(b, d)
            number = torch.zeros(2 * b * d, dtype=torch.long)
            for digit in (1, _DIGIT):
                page = torch.full((1, 1, 2 * b, d), -1.0, dtype=dtype)
                key_pages, value_pages = page.chunk(2, dim=2)
                data = ((index // digit) % _DIGIT).to(dtype)[:, None, :]  # (B, 1, D)
                zeros = torch.zeros_like(data)
                key, value = (data, zeros) if part == "key" else (zeros, data)
                write(key, value, key_pages, value_pages, torch.arange(b, dtype=torch.long))
                flat = page.reshape(-1).float()
                other = (value_pages if part == "key" else key_pages).reshape(-1).float()
                if bool((other > 0).any()):
                    raise RuntimeError(f"layout probe: writing the {part} changed the other half of the page")
                number = number + flat.clamp_min(0).long() * digit
            found.append(number)
        tokens, dims = found
        written = _written(write, part, b, d, dtype)
        where = written.nonzero().flatten()
        if where.numel() != b * d:
            raise RuntimeError(
                f"layout probe: the backend wrote {where.numel()} elements of the {part} for {b * d} values"
            )
        table = torch.full((b, d), -1, dtype=torch.long)
        table[tokens[where], dims[where]] = where
        if bool((table < 0).any()):
            raise RuntimeError(f"layout probe: some (token, dim) of the {part} has no element of its own")
        offsets[part] = table
    return PageLayout(offsets["key"], offsets["value"])


def _written(write: Writer, part: str, b: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Which elements of a page the writer sets for the key (or the value) of all B tokens."""
    page = torch.zeros((1, 1, 2 * b, d), dtype=dtype)
    key_pages, value_pages = page.chunk(2, dim=2)
    ones = torch.ones(b, 1, d, dtype=dtype)
    zeros = torch.zeros_like(ones)
    key, value = (ones, zeros) if part == "key" else (zeros, ones)
    write(key, value, key_pages, value_pages, torch.arange(b, dtype=torch.long))
    return page.reshape(-1) != 0


class PagedKV:
    """Every layer's pages as one flat tensor over their shared storage, with the layout's offsets.

    layers: the per-layer ``[num_blocks, H, B, 2D]`` tensors of the layers that evict (a hybrid's global
    layers; index i here is the i-th of them), in layer order, all views of one
    allocation with the same block and head strides."""

    move_bytes = 16 << 20
    """The most temporary bytes one copy of :meth:`move` allocates (its values and page offsets), so a
    compaction's extra memory is a constant, not a multiple of layers x pairs x heads x 2D."""

    read_bytes = 16 << 20
    """The most temporary bytes one piece of a read (:meth:`gather`) allocates (its int64 page offsets
    and values), so reading a layer costs its result and a constant (issue 57: offsets of every
    head, slot and dim at once were int64 twice over, 1.1 GB at 16 rows of K = 4,096 in a Llama-8B
    shape)."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: PageLayout) -> None:
        first = layers[0]
        _, h, b, two_d = first.shape
        if b != layout.block_size or two_d != 2 * layout.key.shape[1]:
            raise ValueError(
                f"pages {tuple(first.shape)} do not match the probed layout {tuple(layout.key.shape)}"
            )
        for layer in layers:
            if layer.shape != first.shape or layer.stride() != first.stride():
                raise ValueError("every layer's pages must have one shape and one set of strides")
            if layer.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
                raise ValueError("the layers' pages are not views of one allocation")
            if layer.stride(2) != two_d or layer.stride(3) != 1:
                raise ValueError(f"a page must be contiguous, got strides {layer.stride()}")
        self.num_layers, self.num_heads, self.block_size, self.head_dim = len(layers), h, b, two_d // 2
        self.dtype = first.dtype
        storage = first.untyped_storage()
        self.flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            storage, 0, (storage.nbytes() // first.element_size(),), (1,)
        )
        self.layer_base = torch.tensor([layer.storage_offset() for layer in layers], dtype=torch.long)
        self.block_stride, self.head_stride = first.stride(0), first.stride(1)
        self.layout = layout
        self._both = layout.both
        # each layer as (blocks, H, B * 2D) pages: a move indexes block, head and offset in the page
        self.pages = [layer.view(layer.shape[0], h, b * two_d) for layer in layers]
        self._heads = torch.arange(h)[None, :, None]

    # -- addresses ---------------------------------------------------------------------------------
    def _page(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block offset in elements, token within its block) of global slots."""
        return (slots // self.block_size) * self.block_stride, slots % self.block_size

    def keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Keys of ``layer`` at global slots (..., H, L), one row of slots per KV head -> (..., H, L, D)."""
        return self.gather(layer, slots, "key")

    def values(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Values of ``layer`` at global slots (..., H, L) -> (..., H, L, D)."""
        return self.gather(layer, slots, "value")

    def gather(
        self, layer: int, slots: torch.Tensor, part: str, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The keys (``part`` "key") or values of ``layer`` at global slots (..., H, L), as
        (..., H, L, D) in ``dtype`` (the pool's by default): read over :meth:`pieces` of L, so what a
        read allocates beside its result is at most :attr:`read_bytes`."""
        out = torch.empty(*slots.shape, self.head_dim, dtype=dtype or self.dtype, device=self.flat.device)
        for piece in self.pieces(slots):
            out[..., piece, :] = self._piece(layer, slots[..., piece], part)
        return out

    def pieces(self, slots: torch.Tensor) -> list[slice]:
        """Slices of the last dim of ``slots`` (..., H, L) whose reads each hold at most
        :attr:`read_bytes`: two int64 page offsets and one value per element read."""
        per_slot = math.prod(slots.shape[:-1]) * self.head_dim * (2 * 8 + self.flat.element_size())
        step = max(1, self.read_bytes // max(1, per_slot))
        return [slice(lo, lo + step) for lo in range(0, slots.shape[-1], step)]

    def _piece(self, layer: int, slots: torch.Tensor, part: str) -> torch.Tensor:
        """Keys or values of ``layer`` at global slots (..., H, l), in the pool's dtype."""
        block, token = self._page(slots)
        head = torch.arange(self.num_heads)[:, None] * self.head_stride  # (H, 1)
        table = self.layout.key if part == "key" else self.layout.value
        base = block + head + self.layer_base[layer]  # (..., H, l)
        return self.flat[base[..., None] + table[token]]

    # -- moving ------------------------------------------------------------------------------------
    def move(
        self, src: torch.Tensor, dst: torch.Tensor, layers: torch.Tensor | None, heads: torch.Tensor | None
    ) -> None:
        """Copy tokens' keys and values from global slots ``src`` to ``dst`` (both (P,), disjoint).

        layers / heads: (P,) the one layer / head each pair moves in (per-layer / per-head eviction),
        or None for every layer / head. One layer at a time, at most :attr:`move_bytes` of temporaries
        per copy: each copy indexes a layer's pages with (pairs, 1, 1) blocks, heads and (pairs, 1, 2D)
        page offsets that broadcast, so no index of pairs x heads x 2D is ever built (the one-shot gather
        this replaces built two int64 ones of layers x pairs x heads x 2D: with its values, 2.4 GB
        beside a Llama-8B-shaped pool at 16 x 128 moving tokens; docs/vllm.md).
        The order of the copies cannot change the result, because no source slot is a destination."""
        if src.numel() == 0:
            return
        per_pair = self.move_pair_bytes(one_head=heads is not None)
        step = max(1, self.move_bytes // per_pair)
        groups: list[tuple[int, torch.Tensor | None]]
        if layers is None:
            groups = [(layer, None) for layer in range(self.num_layers)]
        else:  # the pairs of each layer, found once (O(P) int64, not per layer)
            order = layers.argsort(stable=True)
            counts = torch.bincount(layers, minlength=self.num_layers).tolist()
            groups = [(layer, part) for layer, part in enumerate(order.split(counts)) if part.numel()]
        count = src.numel()
        for layer, pick in groups:
            pages, n = self.pages[layer], count if pick is None else pick.numel()
            for lo in range(0, n, step):
                part = slice(lo, lo + step) if pick is None else pick[lo : lo + step]
                head = self._heads if heads is None else heads[part][:, None, None]
                # one statement, so no copy's values outlive it into the next copy
                pages[self._where(dst[part], head)] = pages[self._where(src[part], head)]

    def move_pair_bytes(self, one_head: bool) -> int:
        """Temporary bytes one pair costs in a copy of :meth:`move`: its keys and values in every head
        (or one) plus its source and destination page offsets (2D int64 each)."""
        heads = 1 if one_head else self.num_heads
        return heads * 2 * self.head_dim * self.flat.element_size() + 2 * 2 * self.head_dim * 8

    def _where(
        self, slots: torch.Tensor, head: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indices into a layer's pages (blocks, H, B * 2D) of ``slots``' keys and values in ``head``
        ((1, H, 1) every head, or (n, 1, 1) one per slot): (n, 1, 1) blocks, heads, (n, 1, 2D) offsets."""
        blocks, tokens = slots // self.block_size, slots % self.block_size
        return blocks[:, None, None], head, self._both[tokens][:, None, :]
