"""Ranking every rho steps (``CacheSpec.rank_every``, or a row's own: :func:`row_rank_every`; issue
56): what a row keeps of its last ranking, and the token it evicts at each step in between.

At a ranking a row scores its cache as at any compaction and keeps the policy's raw scores beside
its slots, in the arena buffer :data:`RANK` (so they move with their slots and rows, as a policy's
own buffers do); each token written after it is unranked (NaN). At each step in between, a row over
its budget by one evicts, in each layer group and KV head the policy selects by, the lowest-ranked
token still present outside its protected tokens *now* (the prompt or sinks, and the recent window,
which has moved since the ranking), the older one on a tie (as a compaction keeps the newer). Its
slot is freed in place and takes the row's next token: nothing moves. Unranked tokens are never
evicted: a row whose ranking has no candidate left scores again (:meth:`RowBooks.rank_due`).

This module owns the rule for both hosts: :func:`lowest_ranked` (the victim, from plain tensors),
:func:`split_due` (who scores now) and :func:`mark_ranked` (the books of a ranking). epikv's arena
calls them here; the vLLM plugin (:mod:`epikv.vllm.ranking`) calls them on its paged slot store.
"""

from __future__ import annotations

import torch

from epikv.cache.arena import Arena, Writes
from epikv.cache.books import RowBooks
from epikv.selection import protected_slots
from epikv.spec import CacheSpec

RANK = "_rank"
"""The arena buffer of a row's last ranking: the policy's raw score per slot, NaN when unranked."""


def sort_slots(arena: Arena, rows: torch.Tensor | slice, width: int) -> None:
    """Put rows ``rows``' real slots back in positional order, in each layer group and head, holes
    last (tokens written in place since the last ranking sit wherever a token was evicted): a ranking
    scores its cache as every compaction does, so policies that read slot order (Seg's segments,
    ties kept newer) read positional order. A permutation of slots already in order changes nothing."""
    positions = arena.positions[:, rows, :, :width]
    groups = arena.shape.buffer_layers
    key = positions[:groups].long().masked_fill(positions[:groups] < 0, torch.iinfo(torch.long).max)
    index = key.argsort(dim=-1, stable=True)  # (G, b, H, width)
    held = arena.valid[rows, :width].sum(dim=-1)
    valid = torch.arange(width, device=held.device)[None, :] < held[:, None]
    arena.keep_slots(rows, index, valid, held, width)


def store_ranking(
    arena: Arena,
    books: RowBooks,
    order: list[int],
    rows: torch.Tensor | slice,
    scores: torch.Tensor,
    width: int,
) -> None:
    """Keep ``scores`` (G, b, H, width), the policy's scores of rows ``order`` (at ``rows`` of the
    arena), as their ranking, made at their current pass."""
    buf = arena.buffer(RANK, scores.float())
    buf[:, rows, :, :width] = scores.float().expand(buf.shape[0], -1, buf.shape[2], -1)
    mark_ranked(books, order)


def mark_ranked(books: RowBooks, rows: list[int]) -> None:
    """Rows ``rows`` scored their cache and keep the scores as their ranking, made at their current
    pass (their tokens written after it are unranked)."""
    for r in rows:
        books.ranked[r] = books.passes[r]


def evict_in_place(arena: Arena, books: RowBooks, spec: CacheSpec, rows: list[int], width: int) -> None:
    """Each of ``rows`` evicts its lowest-ranked token still present (:func:`victims`) and frees its
    slot for the row's next token."""
    pick = torch.tensor(rows, device=arena.valid.device)
    budgets = [books.budgets[r] for r in rows]
    slots = victims(arena, pick, width, spec, books.prompt_len, books.seen, budgets)  # type: ignore[arg-type]
    arena.free_slots(pick, slots)
    books.evicted_in_place(rows)


def reuse_writes(arena: Arena, books: RowBooks, old_width: int, width: int) -> Writes:
    """A decode step's writes (one token per row) when some rows freed a slot in place: those rows
    write into it, in each layer group and head, the others at their next slot."""
    device, rows = arena.valid.device, len(books)
    freed = arena.freed_slots(rows, old_width, arena.shape.buffer_layers)
    reuse = torch.tensor(books.freed, device=device)[None, :, None]
    slots = torch.where(reuse, freed, torch.tensor(books.fill, device=device)[None, :, None])
    return Writes(rows, width, 1, row_ids=torch.arange(rows, device=device), heads=slots, before=old_width)


def victims(
    arena: Arena,
    rows: torch.Tensor,
    width: int,
    spec: CacheSpec,
    prompt_len: torch.Tensor,
    seen: torch.Tensor,
    budgets: list[int],
) -> torch.Tensor:
    """(G, b, H): the slot each of ``rows`` (b,) evicts in each layer group and head (see the module
    docstring); ``prompt_len``, ``seen`` (B,) are every row's, ``budgets`` those rows'. Each row must
    hold a ranked candidate in every group and head (:meth:`RowBooks.rank_due` says when it does not)."""
    rank = arena.buffers[RANK][:, rows, :, :width]  # (G, b, H, width)
    positions = arena.positions[: rank.shape[0], rows, :, :width]
    return lowest_ranked(rank, positions, prompt_len[rows], seen[rows], recent_windows(spec, budgets), spec)


def recent_windows(spec: CacheSpec, budgets: list[int]) -> torch.Tensor:
    """(b,) the recent window each row protects at its budget."""
    return torch.tensor([spec.policy.recent_window(k) for k in budgets])


def lowest_ranked(
    rank: torch.Tensor,
    positions: torch.Tensor,
    prompt_len: torch.Tensor,
    seen: torch.Tensor,
    recent: torch.Tensor,
    spec: CacheSpec,
) -> torch.Tensor:
    """The one victim rule of both hosts: (G, b, H) the index along L of the token each row evicts in
    each layer group and head: the lowest rank among its candidates (held, ranked, not protected now:
    the prompt or sinks by ``spec``'s policy, and the newest ``recent``), the older one on a tie.

    rank: (G, b, H, L) a ranking's raw scores, NaN where unranked; positions: (G, b, H, L) true
    positions, negative where nothing is held (broadcastable to ``rank``); prompt_len, seen, recent:
    (b,). Each row must hold a candidate in every group and head (:func:`split_due` sees to it)."""
    positions = positions.long().to(rank.device)
    policy = spec.policy
    protected = protected_slots(
        positions,
        prompt_len.to(rank.device),
        seen.to(rank.device),
        protect_prompt=policy.protect_prompt,
        n_sink=policy.n_sink,
        recent=recent.to(rank.device),
    )
    candidate = (positions >= 0) & ~protected & ~rank.isnan()
    key = rank.masked_fill(~candidate, float("inf"))
    lowest = candidate & (key == key.amin(dim=-1, keepdim=True))
    return positions.masked_fill(~lowest, torch.iinfo(torch.long).max).argmin(dim=-1)


def row_rank_every(spec: CacheSpec, books: RowBooks, row: int) -> int | None:
    """Row ``row``'s rho: its own (a vLLM request's ``epikv_rank_every``), else the spec's."""
    rho = books.rank_every[row]
    return spec.rank_every if rho is None else rho


def split_due(spec: CacheSpec, books: RowBooks, due: list[int]) -> tuple[list[int], list[int]]:
    """The rows ``due`` to evict that score their cache now (all of those without a rho:
    :func:`row_rank_every`), and those that evict in place from their ranking."""
    rhos = [row_rank_every(spec, books, r) for r in due]
    ranking = [(r, rho) for r, rho in zip(due, rhos, strict=True) if rho is not None]
    if not ranking:
        return due, []
    policy = spec.policy
    prompt = [books.prompt[r] for r, _ in ranking]
    first = prompt if policy.protect_prompt else [min(policy.n_sink, p) for p in prompt]
    recent = [policy.recent_window(books.budgets[r]) for r, _ in ranking]  # type: ignore[arg-type]
    rank = books.rank_due([r for r, _ in ranking], [rho for _, rho in ranking], first, recent)
    in_place = {r for (r, _), new in zip(ranking, rank, strict=True) if not new}
    return [r for r in due if r not in in_place], [r for r in due if r in in_place]
