"""Compaction over a paged cache: the policy's view of some requests' slots, the one keep rule, and
a hole-filling move.

A request's tokens sit in its physical slots 0..held-1 in no particular order (a compaction fills the
holes below the kept count with the kept tokens above it, so at most tau tokens move per layer).
What a policy sees is ordered by true position, exactly as epikv's own cache holds it, so scores,
ties and the kept set are the same rule on both hosts (:meth:`epikv.spec.CacheSpec.select`).
Under ``rank_every`` (issue 56) a compaction that scores also keeps the scores as the rows' ranking
(:class:`Ranking`, the store's buffer :data:`epikv.cache.ranked.RANK`); the steps in between are
:mod:`epikv.vllm.ranking`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from epikv import scoring
from epikv.cache.ranked import RANK
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec
from epikv.vllm.paged import PagedKV

QueryProjector = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
_LAST = torch.iinfo(torch.int32).max


class PeerFailed(RuntimeError):
    """Another tensor-parallel rank failed the call this rank was in: every rank knows, and every rank
    leaves it at the same collective (:meth:`HeadShards.together`)."""


PEER_FAILED = "another tensor-parallel rank failed this call"


class HeadShards:
    """Tensor parallelism: this rank's pages hold the model's KV heads ``lo..hi-1``. ``gather(t, dim)``
    joins every rank's heads of ``t`` along ``dim`` in rank order; ``share(t)`` gives every rank the
    first rank's ``t``. Policies score whole heads (K/V and queries gathered), so every rank scores
    as one device would, and every rank keeps the first rank's choice: the same positions everywhere.

    Agreement: ``union(flags)`` is the element-wise maximum of an int tensor over the ranks, and
    ``objects(x)`` every rank's ``x`` in rank order. A call that holds collectives runs through
    :meth:`together`: before each collective every rank votes, a rank that raises votes "failed" once
    and leaves, and the others leave at that vote with :class:`PeerFailed`; at the end every rank votes
    again. So no rank ever enters a collective another skips, and every rank gets the same verdict."""

    def __init__(
        self,
        lo: int,
        hi: int,
        gather: Callable[[torch.Tensor, int], torch.Tensor],
        share: Callable[[torch.Tensor], torch.Tensor],
        union: Callable[[torch.Tensor], torch.Tensor],
        objects: Callable[[Any], list[Any]],
    ) -> None:
        self.lo, self.hi = lo, hi
        self._gather, self._share, self.union, self.objects = gather, share, union, objects

    def failed_anywhere(self, failed: bool) -> bool:
        """One vote: whether any rank says it failed (every rank gets the same answer)."""
        return bool(self.union(torch.tensor([int(failed)], dtype=torch.int32))[0])

    def _vote_ok(self) -> None:
        if self.failed_anywhere(False):
            raise PeerFailed(PEER_FAILED)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        self._vote_ok()
        return self._gather(t, dim)

    def share(self, t: torch.Tensor) -> torch.Tensor:
        self._vote_ok()
        return self._share(t)

    def together(self, call: Callable[[], Any]) -> Any:
        """``call()`` on every rank with one verdict: its result where it returned on every rank, else
        an exception on every rank (this rank's own, or :class:`PeerFailed`)."""
        try:
            out = call()
        except PeerFailed:
            raise
        except Exception:
            self.failed_anywhere(True)  # the vote the others are waiting at
            raise
        self._vote_ok()
        return out


class SlotStore:
    """What the pool keeps beside each global slot: its true position and the policy's per-token
    values, (G, H, slots) each, with G and H the policy's granularity (1 for a global mask)."""

    def __init__(self, paged: PagedKV, spec: CacheSpec, model: ModelInfo, num_slots: int) -> None:
        grain = spec.policy.granularity
        self.paged, self.spec, self.model = paged, spec, model
        self.groups = len(model.cache_layers) if "layer" in grain else 1
        self.heads = model.num_kv_heads if "head" in grain else 1
        self.positions = torch.full((self.groups, self.heads, num_slots), -1, dtype=torch.int32)
        self.buffers: dict[str, torch.Tensor] = {}
        self.num_slots = num_slots
        self.project_queries: QueryProjector | None = None
        self.shards: HeadShards | None = None  # set by the runner under tensor parallelism

    def write(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """New tokens at global ``slots`` (T,) with true ``positions`` (T,); under ``rank_every`` they
        are unranked (NaN) until their row's next ranking."""
        self.positions[:, :, slots] = positions.to(torch.int32)
        rank = self.buffers.get(RANK)
        if rank is not None:
            rank[:, :, slots] = float("nan")

    def rank_table(self) -> torch.Tensor:
        """The rows' rankings (:data:`~epikv.cache.ranked.RANK`), (G, H, slots) float32 at the
        store's granularity (so a per-head move moves its head's rank alone), NaN where unranked.
        Made on first use; it is a buffer, so :meth:`copy` moves it with its slot."""
        rank = self.buffers.get(RANK)
        if rank is None:
            rank = self.buffers[RANK] = torch.full_like(self.positions, float("nan"), dtype=torch.float32)
        return rank

    def write_buffer(self, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """A policy's values (G, n, H) for the tokens at global ``slots`` (n,)."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.zeros(values.shape[0], values.shape[2], self.num_slots)
        buf[:, :, slots] = values.permute(0, 2, 1).to(buf.dtype)

    def copy(
        self, src: torch.Tensor, dst: torch.Tensor, groups: torch.Tensor | None, heads: torch.Tensor | None
    ) -> None:
        """Side values of slots ``src`` to ``dst`` (in one group / head each, or all of them)."""
        for table in (self.positions, *self.buffers.values()):
            g = slice(None) if groups is None or table.shape[0] == 1 else groups
            h = slice(None) if heads is None or table.shape[1] == 1 else heads
            table[g, h, dst] = table[g, h, src]


class PagedView:
    """The read-only view a policy scores (``epikv.policies.base.CacheView``): some requests' slots
    in true-position order. slots: (B, L) global slots of each row's physical slots 0..L-1 (any real
    slot past a row's ``held``); held, prompt_len, seen: (B,)."""

    def __init__(
        self,
        store: SlotStore,
        slots: torch.Tensor,
        held: torch.Tensor,
        prompt_len: torch.Tensor,
        seen: torch.Tensor,
        budget: int,
    ) -> None:
        self._store = store
        _b, width = slots.shape
        self.budget = budget
        self.layers: tuple[int, ...] = store.model.cache_layers
        self.num_layers = len(self.layers)
        self.prompt_len, self.seen = prompt_len, seen
        self.slots = slots
        self.valid = torch.arange(width)[None, :] < held[:, None]  # sorted: pads sort last
        raw = store.positions[:, :, slots].permute(0, 2, 1, 3)  # (G, B, H, L)
        keyed = raw.masked_fill(~self.valid[None, :, None, :], _LAST)
        order = keyed.argsort(dim=-1, stable=True)
        self.order = order  # view index -> physical slot index
        self.sorted_positions = raw.gather(-1, order).masked_fill(~self.valid[None, :, None, :], -1).long()
        self.view_slots = slots[None, :, None, :].expand_as(order).gather(-1, order)
        self.buffers = {name: self._gather(buf) for name, buf in store.buffers.items()}

    def _gather(self, table: torch.Tensor) -> torch.Tensor:
        g = torch.arange(table.shape[0])[:, None, None, None]
        h = torch.arange(table.shape[1])[None, None, :, None]
        vs = self.view_slots[: table.shape[0], :, : table.shape[1]]
        return table[g, h, vs]

    def _group(self, layer: int) -> int:
        return self.layers.index(layer) if self._store.groups > 1 else 0

    def _head_slots(self, layer: int) -> torch.Tensor:
        s = self.view_slots[self._group(layer)]  # (B, H or 1, L)
        shards = self._store.shards
        if shards is not None and s.shape[1] > 1:  # per-head order: this rank's heads only
            s = s[:, shards.lo : shards.hi]
        return s.expand(-1, self._store.paged.num_heads, -1)

    def _whole(self, part: torch.Tensor) -> torch.Tensor:
        """(B, this rank's heads, ...) -> (B, every head, ...)."""
        shards = self._store.shards
        return part if shards is None else shards.gather(part.contiguous(), 1)

    def keys(self, layer: int) -> torch.Tensor:
        return self._whole(self._paged(layer, "key"))

    def values(self, layer: int) -> torch.Tensor:
        return self._whole(self._paged(layer, "value"))

    def key_variance(self, layer: int) -> torch.Tensor:
        """(B, H, L): each key's variance over D, read and reduced over the pool's pieces of slots, so
        neither this layer's keys in float32 nor their float64 copy is ever whole."""
        paged = self._store.paged
        slots = self._head_slots(layer)
        out = torch.empty(slots.shape, dtype=torch.float32)
        for piece in paged.pieces(slots):
            keys = paged.gather(self.layers.index(layer), slots[..., piece], "key")
            out[..., piece] = scoring.slot_variance(keys)
        return self._whole(out)

    def _paged(self, layer: int, part: str) -> torch.Tensor:
        """This rank's keys or values of ``layer`` in float32, (B, H, L, D), read in bounded pieces
        (the pages hold the evicting layers only, in order)."""
        index, slots = self.layers.index(layer), self._head_slots(layer)
        return self._store.paged.gather(index, slots, part, torch.float32)

    def positions(self, layer: int | None = None) -> torch.Tensor:
        return self.sorted_positions[self._group(self.layers[0] if layer is None else layer)]

    def project_queries(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._store.project_queries is None:
            raise RuntimeError("epikv: this model cannot recompute queries in vLLM")
        return self._whole(self._store.project_queries(layer, hidden, positions))


@dataclass(frozen=True)
class Ranking:
    """Scores a compaction keeps as its rows' ranking (``rank_every``): view slots (G, b, H, L),
    the global slot of each; scores, the policy's raw scores there (broadcastable to ``slots``);
    valid (b, L), the view slots that hold a token. Written before the compaction's moves, at the
    slots the tokens sit in then, so the moves carry each token's rank to its new slot."""

    slots: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor

    def row(self, i: int) -> Ranking:
        one = slice(i, i + 1)
        scores = self.scores if self.scores.shape[1] == 1 else self.scores[:, one]
        return Ranking(self.slots[:, one], scores, self.valid[one])

    def write(self, store: SlotStore) -> None:
        table = store.rank_table()
        slots = self.slots
        g = torch.arange(slots.shape[0])[:, None, None, None].expand_as(slots)
        h = torch.arange(slots.shape[2])[None, None, :, None].expand_as(slots)
        held = self.valid[None, :, None, :].expand_as(slots)
        table[g[held], h[held], slots[held]] = self.scores.float().expand_as(slots)[held]


@dataclass(frozen=True)
class Compaction:
    """A compaction chosen and not yet done (:func:`choose`): per moving token (P,), its source and
    destination global slots, its layer group and head (None: every one) and its row of the view;
    per row (B,), the kept count and the kept true positions of the first layer group and head (for
    traces); ``ranking``: the scores kept as the rows' ranking (``rank_every``; None: none kept).
    Doing it (:meth:`apply`) twice does what doing it once does, since no source is a destination: a
    copy never changes what another reads (and the ranking is written again at the same slots before
    the same copies). So after a move that raised part-way, each row's part can be done again by
    itself (:meth:`row`)."""

    src: torch.Tensor
    dst: torch.Tensor
    groups: torch.Tensor | None
    heads: torch.Tensor | None
    rows: torch.Tensor
    kept: list[int]
    positions: list[list[int]]
    ranking: Ranking | None = None

    def row(self, i: int) -> Compaction:
        """Row ``i``'s part alone (its moving tokens; it is row 0 of the result)."""
        mine = self.rows == i

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[mine]

        zero = torch.zeros_like(self.rows[mine])
        return Compaction(
            self.src[mine], self.dst[mine], pick(self.groups), pick(self.heads), zero,
            [self.kept[i]], [self.positions[i]], None if self.ranking is None else self.ranking.row(i),
        )  # fmt: skip

    def apply(self, store: SlotStore) -> None:
        """Fill the holes: keys and values (this rank's heads' only, under tensor parallelism), then
        each slot's true position and policy values."""
        src, dst, groups, heads = self.src, self.dst, self.groups, self.heads
        if self.ranking is not None:
            self.ranking.write(store)
        layers = groups  # a group is an evicting layer, and the pages hold exactly those, in order
        if store.shards is not None and heads is not None:  # this rank moves its own heads' tokens
            mine = (heads >= store.shards.lo) & (heads < store.shards.hi)
            local = None if layers is None else layers[mine]
            store.paged.move(src[mine], dst[mine], local, heads[mine] - store.shards.lo)
        else:
            store.paged.move(src, dst, layers, heads)
        store.copy(src, dst, groups, heads)


@dataclass(frozen=True)
class Compacted:
    """What one compaction did: kept tokens per row (B,) and, per row, the kept true positions of the
    first layer group and head (for traces)."""

    kept: list[int]
    positions: list[list[int]]


def choose(store: SlotStore, spec: CacheSpec, state: Any, view: PagedView, rank: bool = False) -> Compaction:
    """Score ``view``'s rows with the policy, keep by the spec's rule, and pair each row's holes below
    its kept count with its kept tokens above it; ``rank``: keep the scores as the rows' ranking
    (``rank_every``). Writes nothing to the pool or the slot store."""
    scores = spec.policy.score(state, view)
    if store.shards is not None:
        scores = store.shards.share(scores.contiguous())
    b = view.slots.shape[0]
    sel = spec.select(
        scores, view.sorted_positions, view.prompt_len, view.seen, view.valid, [view.budget] * b
    )
    order = view.order
    index = sel.index.expand(order.shape[0], -1, order.shape[2], -1)
    kept_slot = order.gather(-1, index)  # (G, B, H, k) physical slot indices
    width = order.shape[-1]
    keep = torch.zeros(*order.shape[:-1], width + 1, dtype=torch.bool)
    real = sel.valid[None, :, None, :].expand_as(kept_slot)
    keep.scatter_(-1, torch.where(real, kept_slot, width), True)
    keep = keep[..., :width]
    below = torch.arange(width)[None, :] < sel.kept[:, None]  # (B, L)
    holes = (~keep & below[None, :, None, :]).nonzero()
    movers = (keep & ~below[None, :, None, :]).nonzero()
    if holes.shape != movers.shape:  # the rule keeps exactly kept[b] slots per (group, row, head)
        raise RuntimeError(f"epikv: compaction found {len(holes)} holes for {len(movers)} kept tokens")
    kept_positions = view.sorted_positions[0, :, 0].gather(-1, sel.index[0, :, 0])
    return Compaction(
        src=view.slots[movers[:, 1], movers[:, 3]],
        dst=view.slots[holes[:, 1], holes[:, 3]],
        groups=movers[:, 0] if store.groups > 1 else None,
        heads=movers[:, 2] if store.heads > 1 else None,
        rows=movers[:, 1],  # holes and movers are both in (group, row, head, slot) order
        kept=sel.kept.tolist(),
        positions=[kept_positions[r, : int(sel.kept[r])].tolist() for r in range(b)],
        ranking=Ranking(view.view_slots, scores, view.valid) if rank else None,
    )


def compact(store: SlotStore, spec: CacheSpec, state: Any, view: PagedView) -> Compacted:
    """Choose a compaction of ``view``'s rows and do it: fill each row's holes below its kept count
    with the kept tokens above it (keys, values, positions, buffers)."""
    done = choose(store, spec, state, view)
    done.apply(store)
    return Compacted(done.kept, done.positions)
