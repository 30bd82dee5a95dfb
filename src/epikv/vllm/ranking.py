"""``rank_every`` (rho, issue 56) in the plugin: the steps between two rankings of a request, each
evicting its lowest-ranked token still present, in each layer group and KV head the policy selects
by, with the rule epikv's own engine uses (:func:`epikv.cache.ranked.lowest_ranked`, fed the slot
store's positions and ranking at the request's physical slots 0..held-1).

A ranking is an ordinary compaction whose scores are kept (:class:`epikv.vllm.compaction.Ranking`,
the store's buffer :data:`epikv.cache.ranked.RANK`, which every move carries with its slot); each
token written after it is unranked (NaN, :meth:`SlotStore.write`), so it is never evicted before the
next ranking, and a request with no ranked candidate left scores again
(:func:`epikv.cache.ranked.split_due`, on the request's own :class:`~epikv.cache.books.RowBooks`).

Why a move and not the new token written into the freed slot (as epikv's arena does): vLLM writes
each new token into one slot for every layer and head (one slot mapping per token), while a per-head
policy frees a different slot in each layer group and head. So the freed slots are filled as a
compaction fills its holes: the token at the request's last physical slot (held - 1) moves into the
victim's slot, in each group and head where they differ, and the request's next token goes to slot
held - 1 as usual. That is one token per group and head per step: constant work, not growing with
the cache. The move is a :class:`~epikv.vllm.compaction.Compaction` of kept count held - 1, done by
the same path as every compaction (retries per row, faults, tensor parallelism: each rank moves its
own heads; every rank holds the first rank's ranking, so every rank picks the same victims).

Prefix caching: the victim is never a protected token, and a policy that shares prompt blocks
protects its whole prompt (scheduler.py), so neither the victim's slot nor the last slot (a token
generated past the prompt) lies in a shared block: nothing shared is written.
"""

from __future__ import annotations

import torch

from epikv.cache.ranked import RANK, lowest_ranked, recent_windows
from epikv.spec import CacheSpec
from epikv.vllm.compaction import Compaction, SlotStore


def choose_in_place(
    store: SlotStore,
    spec: CacheSpec,
    slots: torch.Tensor,
    held: torch.Tensor,
    prompt_len: torch.Tensor,
    seen: torch.Tensor,
    budgets: list[int],
    trace: bool,
) -> Compaction:
    """One eviction from their ranking for each of b rows: slots (b, W) the global slots of each
    row's physical slots 0..W-1 (any slot past a row's ``held``), held, prompt_len, seen (b,),
    ``budgets`` their K. Moves the token at slot held - 1 into the victim's slot in each group and
    head where they differ; ``trace``: give each row's kept positions (first group and head), an
    O(K) read per row done only for traces. Writes nothing."""
    width = slots.shape[1]
    index = torch.arange(width)
    valid = index[None, :] < held[:, None]  # (b, W)
    positions = store.positions[:, :, slots].permute(0, 2, 1, 3)  # (G, b, H, W)
    positions = positions.masked_fill(~valid[None, :, None, :], -1)
    rank = store.buffers[RANK][:, :, slots].permute(0, 2, 1, 3)
    victim = lowest_ranked(rank, positions, prompt_len, seen, recent_windows(spec, budgets), spec)
    last = held - 1
    g, r, h = (victim != last[None, :, None]).nonzero().unbind(1)
    kept = [[] for _ in range(slots.shape[0])]
    if trace:
        first = positions[0, :, 0].long()  # (b, W)
        gone = index[None, :] == victim[0, :, 0, None]
        kept = [sorted(first[i][valid[i] & ~gone[i]].tolist()) for i in range(slots.shape[0])]
    return Compaction(
        src=slots[r, last[r]],
        dst=slots[r, victim[g, r, h]],
        groups=g if store.groups > 1 else None,
        heads=h if store.heads > 1 else None,
        rows=r,
        kept=last.tolist(),
        positions=kept,
    )
