"""Reads of a paged pool for scoring (epikv's own environment, no vLLM): ``PagedKV.gather`` equals the
pages element by element at every piece size, and what it and Seg's key variance allocate beside
their result is a constant, not int64 offsets and float64 copies of every head, slot and dim (issue
57, torch's profiler counts them)."""

from __future__ import annotations

import pytest
import torch

from epikv import scoring
from epikv.bench.shared.machine import peak_allocated
from epikv.policies.base import ModelInfo
from epikv.policies.epikv_seg import mean_key_variance
from epikv.spec import CacheSpec
from epikv.vllm.compaction import PagedView, SlotStore
from tests.plugin_without_vllm.test_paged_move import BLOCKS, B, D, H, pool

ROWS = 2


def slots_of(length: int, seed: int = 3) -> torch.Tensor:
    """(ROWS, H, length) global slots, scattered over the pool, one row of slots per head."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(BLOCKS * B, generator=g)[:length] for _ in range(ROWS)])
    return rows[:, None].expand(-1, H, -1)


def by_hand(buf: torch.Tensor, paged, layer: int, slots: torch.Tensor, part: str) -> torch.Tensor:
    """What a read must give, one element at a time from the layout's offsets."""
    table = (paged.layout.key if part == "key" else paged.layout.value).tolist()
    base, block, head = int(paged.layer_base[layer]), paged.block_stride, paged.head_stride
    out = torch.empty(*slots.shape, D, dtype=buf.dtype)
    for r in range(slots.shape[0]):
        for h in range(H):
            for i, s in enumerate(slots[r, h].tolist()):
                for d in range(D):
                    out[r, h, i, d] = buf[base + (s // B) * block + h * head + table[s % B][d]]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("read_bytes", [1, 5000, 1 << 30])  # a slot a piece, some, all at once
def test_a_read_equals_the_pages_element_by_element(dtype, read_bytes):
    buf, paged = pool(3, dtype)
    paged.read_bytes = read_bytes
    slots = slots_of(21)
    for layer in (0, 2):
        for part in ("key", "value"):
            want = by_hand(buf, paged, layer, slots, part)
            assert torch.equal(paged.gather(layer, slots, part), want)
            assert torch.equal(paged.gather(layer, slots, part, torch.float32), want.float())
    assert torch.equal(paged.keys(1, slots), by_hand(buf, paged, 1, slots, "key"))
    assert torch.equal(paged.values(1, slots), by_hand(buf, paged, 1, slots, "value"))


def test_a_reads_temporaries_stay_under_read_bytes_whatever_the_slots():
    """Beside its (rows, H, L, D) result a read holds at most ``read_bytes`` (the old read built two
    int64 offsets of rows x H x L x D at once: 16 bytes an element against the result's 4)."""
    _, paged = pool(2)
    paged.read_bytes = 4 * H * ROWS * D * (2 * 8 + 4)  # four slots a piece
    for length in (40, 90):
        slots = slots_of(length)
        result = ROWS * H * length * D * 4
        extra = peak_allocated(lambda s=slots: paged.keys(1, s)) - result
        assert 0 < extra <= paged.read_bytes + 1024, (length, extra)  # + the pieces' (H, l) bases


def seg_view(layers: int, length: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, PagedView]:
    """A Seg view of ROWS rows holding ``length`` tokens each (true positions shuffled over the
    slots), on a pool of ``layers`` layers."""
    buf, paged = pool(layers, dtype)
    buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(4)).to(dtype) * 3)
    model = ModelInfo("t", layers, 2 * H, H, D, 2 * H * D)
    spec = CacheSpec.build(model, "epikv-seg", 32, params={"band_a": 0, "band_b": 1})
    store = SlotStore(paged, spec, model, BLOCKS * B)
    rows = torch.randperm(BLOCKS * B, generator=torch.Generator().manual_seed(5))[: ROWS * length]
    rows = rows.view(ROWS, length)
    for row in rows:
        store.write(row, torch.randperm(length, generator=torch.Generator().manual_seed(6)))
    n = torch.full((ROWS,), length)
    return buf, PagedView(store, rows, n, torch.full((ROWS,), 4), n, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_views_key_variance_is_the_dense_keys_variance_bit_for_bit(dtype):
    """Read and reduced in pieces, in true-position order: what epikv's own cache gives from dense
    keys (``scoring.slot_variance``, the one function both hosts call)."""
    _, view = seg_view(2, 48, dtype)
    paged = view._store.paged
    for read_bytes in (1, 3000, 1 << 30):
        paged.read_bytes = read_bytes
        for layer in (0, 1):
            dense = paged.keys(layer, view.view_slots[0].expand(-1, H, -1))  # (ROWS, H, L, D)
            assert torch.equal(view.key_variance(layer), scoring.slot_variance(dense))
            want = dense.double().var(dim=-1, correction=0)
            torch.testing.assert_close(view.key_variance(layer).double(), want, rtol=1e-6, atol=0)


def test_segs_key_variance_holds_no_whole_layer_of_keys():
    """Seg averages the key variance over every layer: it now holds (ROWS, H, L) float32 variances
    and one piece of keys at a time; it held a (ROWS, H, L, D) int64 offset table for the whole view
    plus a float32 and two float64 copies of each layer's keys (56 bytes an element)."""
    length = 48
    _, view = seg_view(3, length)
    paged = view._store.paged
    piece = 2 * H * ROWS * D  # elements of a piece of two slots
    paged.read_bytes = piece * (2 * 8 + 4)
    variances = ROWS * H * length * 4
    peak = peak_allocated(lambda: mean_key_variance(view))
    assert 0 < peak <= 3 * variances + paged.read_bytes + piece * 8 + 4096, peak
    assert peak < ROWS * H * length * D * 56 / 10
