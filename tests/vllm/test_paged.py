"""The page layout probe, reads and the hole-filling compaction against vLLM's own CPU ops (no engine):
what the backend's writer stored is read back exactly, and attention by vLLM's kernel over a compacted
request equals dense attention over exactly the kept keys and values."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec
from epikv.vllm.compaction import PagedView, SlotStore, compact
from epikv.vllm.paged import PagedKV, probe_layout

B, D, H, HQ, LAYERS, BLOCKS = 32, 64, 3, 6, 2, 8
DTYPES = [torch.float32, torch.bfloat16]


def writer(dtype: torch.dtype):
    isa = _get_attn_isa(dtype, B, D)
    return isa, lambda k, v, kp, vp, s: ops.cpu_attn_reshape_and_cache(k, v, kp, vp, s, isa)


def pool(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One backing buffer holding LAYERS layers of BLOCKS x H pages, as vLLM allocates it."""
    per_layer = BLOCKS * H * B * 2 * D
    buf = torch.zeros(LAYERS * per_layer, dtype=dtype)
    return buf, [buf[i * per_layer : (i + 1) * per_layer].view(BLOCKS, H, B, 2 * D) for i in range(LAYERS)]


def write(pages: torch.Tensor, isa: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    key_pages, value_pages = pages.view(BLOCKS, H, 2 * B, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_pages, value_pages, slots, isa)


@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_finds_every_element_and_reads_back_what_the_backend_wrote(dtype):
    isa, write_fn = writer(dtype)
    layout = probe_layout(write_fn, B, D, dtype)
    assert sorted(torch.cat([layout.key.flatten(), layout.value.flatten()]).tolist()) == list(
        range(2 * B * D)
    )
    _, layers = pool(dtype)
    torch.manual_seed(0)
    slots = torch.randperm(BLOCKS * B)[:70]
    keys = [torch.randn(70, H, D).to(dtype) for _ in layers]
    values = [torch.randn(70, H, D).to(dtype) for _ in layers]
    for pages, k, v in zip(layers, keys, values, strict=True):
        write(pages, isa, k, v, slots)
    paged = PagedKV(layers, layout)
    per_head = slots.expand(H, -1)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        assert torch.equal(paged.keys(i, per_head), k.transpose(0, 1))
        assert torch.equal(paged.values(i, per_head), v.transpose(0, 1))


def test_probe_refuses_a_writer_that_drops_elements():
    def lossy(k, v, kp, vp, s):
        kp[0, 0, :, :-1] = k[:, 0, :-1]  # row-major, last dim never written

    with pytest.raises(RuntimeError, match="layout probe"):
        probe_layout(lossy, B, D, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compaction_then_vllm_attention_equals_dense_attention_over_the_kept_tokens(dtype):
    isa, write_fn = writer(dtype)
    _, layers = pool(dtype)
    paged = PagedKV(layers, probe_layout(write_fn, B, D, dtype))
    model = ModelInfo("t", LAYERS, HQ, H, D, HQ * D)
    spec = CacheSpec.build(model, "streaming", 50)  # keeps 4 sinks + the last 46
    store = SlotStore(paged, spec, model, BLOCKS * B)
    block_ids = torch.tensor([5, 2, 7])
    seen = 80
    slots = (block_ids[:, None] * B + torch.arange(B)).reshape(-1)[:seen]
    torch.manual_seed(1)
    k = torch.randn(LAYERS, seen, H, D).to(dtype)
    v = torch.randn(LAYERS, seen, H, D).to(dtype)
    for i, pages in enumerate(layers):
        write(pages, isa, k[i], v[i], slots)
    store.write(slots, torch.arange(seen))
    view = PagedView(store, slots[None], torch.tensor([seen]), torch.tensor([10]), torch.tensor([seen]), 50)
    done = compact(store, spec, None, view)
    kept = [0, 1, 2, 3, *range(seen - 46, seen)]
    assert done.kept == [50] and done.positions == [kept]
    assert sorted(store.positions[0, 0, slots[:50]].tolist()) == kept  # slots 0..49 hold the kept tokens
    query = torch.randn(1, HQ, D).to(dtype)
    out = torch.empty(1, HQ, D, dtype=dtype)
    seq_lens, start = torch.tensor([50], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    for i, pages in enumerate(layers):
        key_pages, value_pages = pages.view(BLOCKS, H, 2 * B, D).chunk(2, dim=2)
        meta = ops.cpu_attn_get_scheduler_metadata(1, HQ, H, D, seq_lens, dtype, start, True, -1, isa, False)
        ops.cpu_attention_with_kv_cache(
            query,
            key_pages,
            value_pages,
            out,
            start,
            seq_lens,
            D**-0.5,
            True,
            None,
            -1,
            table,
            0.0,
            meta,
            None,
        )
        kk = k[i, kept].float().repeat_interleave(HQ // H, dim=1).transpose(0, 1)  # (HQ, 50, D)
        vv = v[i, kept].float().repeat_interleave(HQ // H, dim=1).transpose(0, 1)
        dense = torch.softmax(query.float().transpose(0, 1) @ kk.transpose(1, 2) * D**-0.5, dim=-1) @ vv
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), dense.transpose(0, 1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_writer_skips_slot_minus_one_so_a_faulted_row_writes_nowhere(dtype):
    isa, _ = writer(dtype)
    buf, pages = pool(dtype)
    k, v = torch.randn(3, H, D).to(dtype), torch.randn(3, H, D).to(dtype)
    write(pages[0], isa, k, v, torch.tensor([5, -1, 7]))
    written = buf.clone()
    write(pages[0], isa, k[:2], v[:2], torch.tensor([-1, -1]))
    assert torch.equal(buf, written)  # nothing moved
    buf.zero_()
    write(pages[0], isa, k[1:2], v[1:2], torch.tensor([-1]))
    assert not buf.any()
