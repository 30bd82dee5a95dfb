"""The one selection function: true top-k, protection, order, holes."""

from __future__ import annotations

import torch

from epikv.selection import gather_slots, protected_slots, select_keep


def test_keeps_true_topk_plus_protected_in_order():
    torch.manual_seed(0)
    scores = torch.randn(1, 1, 1, 20)
    protected = torch.zeros(1, 20, dtype=torch.bool)
    protected[0, [0, 1, 19]] = True
    valid = torch.ones(1, 20, dtype=torch.bool)
    sel = select_keep(scores, protected, valid, torch.tensor([8]))
    kept = sel.index[0, 0, 0].tolist()
    free = [i for i in range(20) if i not in (0, 1, 19)]
    best = sorted(free, key=lambda i: -float(scores[0, 0, 0, i]))[:5]
    assert kept == sorted([0, 1, 19, *best])
    assert sel.valid.all() and sel.kept.tolist() == [8]


def test_minus_inf_is_dropped_and_rows_get_end_holes():
    scores = torch.zeros(1, 2, 1, 6)
    scores[0, 1, 0, 2:] = float("-inf")  # row 1 may keep only slots 0, 1
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, 0] = False  # row 0 slot 0 is padding
    sel = select_keep(scores, torch.zeros(2, 6, dtype=torch.bool), valid, torch.tensor([4, 4]))
    assert sel.kept.tolist() == [4, 2]
    # Kept slots first, holes last: the cache writes a row's kept slots at the front of its row.
    assert sel.valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert sel.index[0, 0, 0].tolist() == [2, 3, 4, 5]  # padding never kept; ties keep the newer slot
    assert sel.index[0, 1, 0, :2].tolist() == [0, 1]


def test_per_head_selection_and_gather():
    scores = torch.tensor([[[[3.0, 1.0, 2.0], [1.0, 3.0, 2.0]]]])  # G=1, B=1, H=2, L=3
    valid = torch.ones(1, 3, dtype=torch.bool)
    sel = select_keep(scores, torch.zeros(1, 3, dtype=torch.bool), valid, torch.tensor([2]))
    assert sel.index[0, 0].tolist() == [[0, 2], [1, 2]]
    x = torch.arange(6.0).reshape(1, 2, 3, 1)
    assert gather_slots(x, sel.index[0]).flatten().tolist() == [0.0, 2.0, 4.0, 5.0]


def test_protected_slots_rules():
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, -1]])[None, :, None, :].expand(1, 1, 1, 7)
    prot = protected_slots(pos, torch.tensor([2]), torch.tensor([6]), protect_prompt=True, n_sink=0, recent=2)
    assert prot[0, 0, 0].tolist() == [True, True, False, False, True, True, False]
    prot = protected_slots(
        pos, torch.tensor([2]), torch.tensor([6]), protect_prompt=False, n_sink=1, recent=0
    )
    assert prot[0, 0, 0].tolist() == [True] + [False] * 6


def test_gather_slots_equals_elementwise_gather_on_every_view_of_a_cache():
    """The row-copy path (slots contiguous in storage) and the fallback give gather's exact values,
    on the storage itself, views of its first slots, of some rows or heads, and a transposed view."""
    torch.manual_seed(0)
    store = torch.randn(7, 3, 50, 8)
    views = [store, store[:, :, :20], store[2:5, :, :33], store[:, 1:, :12], store[[4, 1]][:, :, :10]]
    views.append(store.transpose(2, 3)[:, :, :5])  # slots not contiguous: the fallback
    for x in views:
        for heads in (1, x.shape[1]):
            index = torch.randint(0, x.shape[2], (x.shape[0], heads, 6))
            full = index.expand(x.shape[0], x.shape[1], -1).unsqueeze(-1).expand(-1, -1, -1, x.shape[3])
            assert torch.equal(gather_slots(x, index), x.gather(2, full))
