"""``PagedKV.move`` on a synthetic pool (epikv's own environment, no vLLM): the move equals a copy
computed element by element from the page layout, in every granularity and at every chunk size, and
its temporaries do not grow with layers, pairs or heads x 2D (torch's profiler counts them)."""

from __future__ import annotations

import pytest
import torch

from epikv.bench.shared.machine import peak_allocated
from epikv.vllm.paged import PagedKV, PageLayout

B, D, H, BLOCKS = 8, 16, 4, 12
GAP = 7  # elements between layers: layer bases that are no multiple of a page


def layout(seed: int = 0) -> PageLayout:
    """A scrambled page: keys in the first half, values in the second, each (token, dim) anywhere."""
    g = torch.Generator().manual_seed(seed)
    half = B * D
    key = torch.randperm(half, generator=g).view(B, D)
    value = half + torch.randperm(half, generator=g).view(B, D)
    return PageLayout(key, value)


def pool(layers: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, PagedKV]:
    """``layers`` layers of BLOCKS x H pages in one buffer, with a gap before each, filled with
    distinct values (exact in ``dtype``)."""
    per_layer = BLOCKS * H * B * 2 * D
    buf = (torch.arange(layers * (per_layer + GAP)) % 251).to(dtype)
    views = [
        buf[i * (per_layer + GAP) + GAP : (i + 1) * (per_layer + GAP)].view(BLOCKS, H, B, 2 * D)
        for i in range(layers)
    ]
    return buf, PagedKV(views, layout())


def reference(buf: torch.Tensor, paged: PagedKV, src, dst, layers, heads) -> torch.Tensor:
    """The move done one element at a time from the layout's offsets, into a copy of ``buf``."""
    out = buf.clone()
    both = torch.cat([paged.layout.key, paged.layout.value], dim=1).tolist()
    base, block, head = paged.layer_base.tolist(), paged.block_stride, paged.head_stride
    for p, (s, d) in enumerate(zip(src.tolist(), dst.tolist(), strict=True)):
        for layer in range(paged.num_layers) if layers is None else [int(layers[p])]:
            for h in range(paged.num_heads) if heads is None else [int(heads[p])]:
                for j in range(2 * D):
                    to = base[layer] + (d // B) * block + h * head + both[d % B][j]
                    out[to] = buf[base[layer] + (s // B) * block + h * head + both[s % B][j]]
    return out


def pairs(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """n disjoint (source, destination) global slots, scattered over the pool's blocks."""
    slots = torch.randperm(BLOCKS * B, generator=torch.Generator().manual_seed(seed))[: 2 * n]
    return slots[:n], slots[n:]


@pytest.mark.parametrize("grain", ["global", "layer", "head", "layer-head"])
@pytest.mark.parametrize("move_bytes", [1, 3000, 1 << 30])  # a pair a copy, some, all at once
def test_move_equals_the_copy_element_by_element(grain, move_bytes):
    buf, paged = pool(3)
    paged.move_bytes = move_bytes
    src, dst = pairs(20)
    g = torch.Generator().manual_seed(2)
    layers = torch.randint(0, 3, (20,), generator=g) if "layer" in grain else None
    heads = torch.randint(0, H, (20,), generator=g) if "head" in grain else None
    expected = reference(buf, paged, src, dst, layers, heads)
    assert not torch.equal(expected, buf)  # the move changes something
    paged.move(src, dst, layers, heads)
    assert torch.equal(buf, expected)  # every element: moved ones, untouched ones, the gaps


def test_move_in_bfloat16_and_an_empty_move():
    buf, paged = pool(2, torch.bfloat16)
    src, dst = pairs(9)
    expected = reference(buf, paged, src, dst, None, None)
    paged.move(src, dst, None, None)
    assert torch.equal(buf, expected)
    before = buf.clone()
    paged.move(src[:0], dst[:0], None, None)
    assert torch.equal(buf, before)


def peak(layers: int, n: int, grain: str, move_bytes: int) -> int:
    _, paged = pool(layers)
    paged.move_bytes = move_bytes
    src, dst = pairs(n)
    per_layer = torch.arange(n) % layers if grain == "layer" else None
    per_head = torch.arange(n) % H if grain == "head" else None
    return peak_allocated(lambda: paged.move(src, dst, per_layer, per_head))


@pytest.mark.parametrize("grain", ["global", "layer", "head"])
def test_the_moves_temporaries_do_not_grow_with_layers_or_pairs(grain):
    """The one-shot gather this replaced held two int64 indices of layers x pairs x heads x 2D; now a
    copy holds at most ``move_bytes``, a whole number of pairs' values and source and destination
    offsets, whatever the layers and pairs. Per-layer moves add a (pairs,) int64 order: all that grows."""
    pair = (1 if grain == "head" else H) * 2 * D * 4 + 2 * 2 * D * 8  # fp32 values, int64 offsets
    move_bytes = 4 * pair  # four pairs a copy
    small, more_layers = peak(2, 8, grain, move_bytes), peak(6, 8, grain, move_bytes)
    more_pairs = peak(2, 24, grain, move_bytes)
    order = 8 * 8 + 64 if grain == "layer" else 0  # 8 pairs' int64 order, the layers' counts
    assert 0 < small <= move_bytes + order
    if grain == "layer":  # at 6 layers each layer has fewer of the 8 pairs; 16 more pairs, 16 more int64
        assert more_layers <= small and more_pairs - small <= 16 * 8 + 64
    else:
        assert more_layers == small and more_pairs == small
    old_index = 2 * 8 * 6 * 8 * (1 if grain == "head" else H) * 2 * D  # the old code's two, at 6 layers
    assert more_layers < old_index / 10
