"""The budgeted KV cache: transformers cache layers that keep true positions and evict by policy.

This module owns, per row of a batch: the budget K, the compaction interval tau and its own
schedule (a row compacts when it holds more than K tokens and tau decode steps have passed since its
last compaction, whatever the other rows do), each slot's true position, which slots are real (left
padding and batch "holes" are not; holes always form a prefix of a row), the per-token values
policies store, the policy's per-row state, and the counters users read. Rows can be taken out and
spliced in between steps (:meth:`BudgetedCache.take_rows`, :meth:`BudgetedCache.append`), which is
what the engine's continuous batching rests on. It calls the policy through two narrow calls
(``observe`` each step, ``score`` at a compaction) and never branches on a policy's type. It does not
know the model: the integration module feeds it each step's new tokens (:meth:`begin_step`) and
signals (:meth:`end_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from epikv.cache.layer import BudgetedLayer, left_pad, rewrite_token_rows
from epikv.cache.view import CacheView, SequenceStats
from epikv.policies.base import ModelInfo, StepSignals
from epikv.policies.rows import cat_rows, take_rows
from epikv.selection import Selection, gather_tokens, protected_slots, select_keep
from epikv.spec import CacheSpec

# Per-row host-side lists that move with their row (take_rows, append).
_BOOKS = ("held", "since", "budgets", "peak", "evicted", "row_compactions", "held_sum", "passes")

QueryProjector = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class BudgetedCache(Cache):
    """A cache holding at most K real tokens per row after each of the row's compactions, and at most
    K + tau in between. The spec's budget None never evicts (the ``full`` policy); ``budget`` narrows
    this cache's K below the spec's (a request's own budget)."""

    def __init__(self, spec: CacheSpec, model: ModelInfo, budget: int | None = None) -> None:
        if budget is not None and (spec.budget is None or not 0 < budget <= spec.budget):
            raise ValueError(f"a row budget must be in 1..{spec.budget} (the spec's), got {budget}")
        super().__init__(layers=[BudgetedLayer() for _ in range(model.num_layers)])
        self.spec = spec
        self.policy = spec.policy
        self.budget = budget if budget is not None else spec.budget
        self.interval = spec.interval
        self.model = model
        self.project_queries: QueryProjector | None = None
        self.owner: Any = None  # the attachment whose hooks feed this cache
        self._clear()

    def _clear(self) -> None:
        self.state: Any = None
        self.valid: torch.Tensor | None = None
        self.prompt_len = self.seen = torch.zeros(0, dtype=torch.long)
        self.buffers: dict[str, torch.Tensor] = {}
        self.compactions = 0
        self._pending: torch.Tensor | None = None
        self.has_holes = False
        # A long prompt comes in several forwards (epikv.engine.runner): ``prompt_follows`` is set
        # before each forward but the last, and the next forward then continues the prefill.
        self.prompt_follows = False
        self._prefill_open = False
        # Host-side per-row books, so the decode step never waits on the device to decide anything.
        self.held: list[int] = []
        self.since: list[int] = []
        self.budgets: list[int | None] = []
        self.peak: list[int] = []
        self.evicted: list[int] = []
        self.row_compactions: list[int] = []
        # Cached tokens summed over decode passes (after each pass's new tokens), and the passes:
        # their ratio is the mean cache a row held, the memory a policy costs on average.
        self.held_sum: list[int] = []
        self.passes: list[int] = []

    def reset(self) -> None:
        super().reset()
        self._clear()

    @property
    def started(self) -> bool:
        return self.valid is not None

    @property
    def batch_size(self) -> int:
        return len(self.held)

    @property
    def in_prefill(self) -> bool:
        """Whether the next forward feeds prompt tokens (the first one, or a later chunk of a prompt)."""
        return not self.started or self._prefill_open

    def update(self, key_states, value_states, layer_idx: int, *args: Any, **kwargs: Any):
        kwargs["positions"] = self._pending
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    # -- step protocol used by the integration module -------------------------------------------
    def next_positions(self, new_valid: torch.Tensor) -> torch.Tensor:
        """True positions of the new tokens (B, q): tokens seen so far plus their rank; 0 at pads."""
        seen = self.seen if self.started else torch.zeros(new_valid.shape[0], dtype=torch.long)
        ranks = new_valid.long().cumsum(dim=-1) - 1
        return (seen.to(new_valid.device)[:, None] + ranks).clamp_min(0)

    def begin_step(self, new_valid: torch.Tensor, positions: torch.Tensor) -> None:
        batch, q = new_valid.shape
        if not self.started:
            self.prompt_len = new_valid.sum(dim=-1)
            self.seen = torch.zeros(batch, dtype=torch.long, device=new_valid.device)
            prompts = self.prompt_len.tolist()  # one host sync per prefill
            for tokens in prompts:
                self.spec.check_prompt(tokens, self.budget)
            self.state = self.policy.init_state(batch, self.model, new_valid.device)
            self.valid = new_valid.clone()
            self.has_holes = not bool(new_valid.all())
            self.held, self.peak = list(prompts), list(prompts)
            self.since = [self.interval] * batch  # a row may compact right after its prefill
            self.budgets = [self.budget] * batch
            self.evicted, self.row_compactions = [0] * batch, [0] * batch
            self.held_sum, self.passes = [0] * batch, [0] * batch
        else:  # later passes feed q real tokens to every row (the attention mask is ours)
            chunk = self._prefill_open  # a later chunk of the prompt: the prompt grows, nothing is decoded
            if chunk:
                self.prompt_len = self.prompt_len + new_valid.sum(dim=-1)
                for tokens in self.prompt_len.tolist():  # one host sync per chunk
                    self.spec.check_prompt(tokens, self.budget)
            self.valid = torch.cat([self.valid, new_valid], dim=-1)
            self.held = [h + q for h in self.held]
            self.peak = [max(p, h) for p, h in zip(self.peak, self.held, strict=True)]
            if not chunk:  # a decode pass: counted for the mean cache a row holds
                self.held_sum = [s + h for s, h in zip(self.held_sum, self.held, strict=True)]
                self.passes = [n + 1 for n in self.passes]
        self._pending = positions.masked_fill(~new_valid, -1).to(torch.int32)

    def end_step(self, signals: StepSignals) -> None:
        signals.buffers = self.buffers
        signals.slots_valid = self.valid
        total = self.valid.shape[-1]
        for name, value in self.policy.observe(self.state, signals).items():
            old = self.buffers.get(name)
            if old is None or value.shape[-1] == total:
                self.buffers[name] = value
            else:
                self.buffers[name] = torch.cat([old, value.to(old.dtype)], dim=-1)
        self.seen = self.seen + signals.valid.sum(dim=-1)
        if not signals.prefill:
            self.since = [s + 1 for s in self.since]
        self._prefill_open, self.prompt_follows = self.prompt_follows, False
        if self._prefill_open:  # no compaction inside a prompt: its tokens are all protected or seen
            return
        due = self.due_rows()
        if due:
            self.compact(due)

    def due_rows(self) -> list[int]:
        """Rows over their budget whose interval has passed since their last compaction."""
        rows = zip(self.held, self.since, self.budgets, strict=True)
        return [r for r, (h, s, k) in enumerate(rows) if k is not None and h > k and s >= self.interval]

    # -- compaction ----------------------------------------------------------------------------
    def compact(self, rows: Sequence[int] | None = None) -> None:
        """Score, select and gather ``rows`` (default: every row with a budget): the only place
        tokens leave the cache. Each budget among ``rows`` is scored in one call, so a policy always
        sees one K. Other rows are not touched: when only some rows compact, theirs are rewritten
        in place (kept slots at the end, holes before them), so the cost follows the rows compacted."""
        rows = (
            sorted(r for r, k in enumerate(self.budgets) if k is not None) if rows is None else sorted(rows)
        )
        if not rows:
            return
        groups = {
            k: [r for r in rows if self.budgets[r] == k] for k in sorted({self.budgets[r] for r in rows})
        }
        scores = torch.cat([self._score(group, k) for k, group in groups.items()], dim=1)
        order = [r for group in groups.values() for r in group]
        identity = order == list(range(self.batch_size))
        index = torch.tensor(order, device=self.valid.device)

        def pick(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
            return x if identity else x.index_select(dim, index)

        budgets = [self.budgets[r] for r in order]
        recent = torch.tensor([self.policy.recent_window(k) for k in budgets], device=self.valid.device)
        protected = protected_slots(
            pick(self._positions_for(scores), 1),
            pick(self.prompt_len),
            pick(self.seen),
            protect_prompt=self.policy.protect_prompt,
            n_sink=self.policy.n_sink,
            recent=recent,
        )
        sel = select_keep(
            scores, protected, pick(self.valid), torch.tensor(budgets, device=self.valid.device)
        )
        if len(order) == self.batch_size:
            self._gather_all(sel, order)
        else:
            self._rewrite_rows(sel, index)
        for r, kept in zip(order, sel.kept.tolist(), strict=True):
            self.evicted[r] += self.held[r] - kept
            self.held[r] = kept
            self.since[r] = 0
            self.row_compactions[r] += 1
        self._trim()
        self.compactions += 1

    def _gather_all(self, sel: Selection, order: list[int]) -> None:
        """Every row compacts: one gather per tensor (rows may come in budget order: put them back)."""
        back = sorted(range(len(order)), key=order.__getitem__)
        if back != list(range(len(order))):
            sel = Selection(sel.index[:, back], sel.valid[back], sel.kept[back])
        for i, layer in enumerate(self.layers):
            layer.compact(sel.index[i if sel.index.shape[0] > 1 else 0], sel.valid)
        self.buffers = {name: gather_tokens(buf, sel.index) for name, buf in self.buffers.items()}
        self.valid = sel.valid

    def _rewrite_rows(self, sel: Selection, rows: torch.Tensor) -> None:
        """Some rows compact: their kept slots are written at the end of their own rows."""
        for i, layer in enumerate(self.layers):
            layer.rewrite_rows(rows, sel.index[i if sel.index.shape[0] > 1 else 0], sel.valid)
        for name, buf in self.buffers.items():
            self.buffers[name] = rewrite_token_rows(buf, rows, sel.index)
        length, k = self.valid.shape[-1], sel.valid.shape[-1]
        self.valid[rows] = torch.nn.functional.pad(sel.valid, (length - k, 0), value=False)

    def _trim(self) -> None:
        """Drop the hole prefix every row shares (rows hold their real slots at the end)."""
        length, longest = self.valid.shape[-1], max(self.held)
        if longest < length:
            cut = length - longest
            for layer in self.layers:
                layer.take_rows(None, cut)
            self.valid = self.valid[:, cut:]
            self.buffers = {name: buf[..., cut:] for name, buf in self.buffers.items()}
        self.has_holes = min(self.held) < longest

    def _score(self, rows: list[int], budget: int) -> torch.Tensor:
        """The policy's scores for ``rows`` at one budget, (G, len(rows), H, L). The policy sees those
        rows only (and their state, written back after: scoring may advance it)."""
        if len(rows) == self.batch_size:
            return self.policy.score(self.state, CacheView(self, None, budget))
        state = take_rows(self.state, rows)
        scores = self.policy.score(state, CacheView(self, rows, budget))
        others = [r for r in range(self.batch_size) if r not in rows]
        merged = cat_rows([take_rows(self.state, others), state])
        order = others + rows
        self.state = take_rows(merged, sorted(range(len(order)), key=order.__getitem__))
        return scores

    def _positions_for(self, scores: torch.Tensor) -> torch.Tensor:
        """Slot positions shaped like the scores' (G, B, H, L) layout."""
        if scores.shape[0] > 1:
            return torch.stack([layer.positions for layer in self.layers])
        return self.layers[0].positions[None]

    # -- rows (continuous batching) ----------------------------------------------------------------
    def take_rows(self, index: Sequence[int]) -> None:
        """Keep only rows ``index`` (in that order), freeing what the others held; a hole prefix
        common to every kept row is cut off."""
        index = list(index)
        held = [self.held[r] for r in index]
        if not index:
            self.reset()
            return
        trim = self.valid.shape[-1] - max(held)
        rows = torch.tensor(index, dtype=torch.long, device=self.valid.device)
        for layer in self.layers:
            layer.take_rows(rows, trim)
        self.valid = self.valid[rows, trim:]
        self.buffers = {name: buf[:, rows, :, trim:] for name, buf in self.buffers.items()}
        self.prompt_len, self.seen = self.prompt_len[rows], self.seen[rows]
        self.state = take_rows(self.state, index)
        for name in _BOOKS:
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in index])
        self.has_holes = min(held) < max(held)

    def append(self, other: BudgetedCache) -> None:
        """Splice the rows of ``other`` (same spec, already prefilled) in after this cache's rows."""
        if other.spec != self.spec:
            raise ValueError("only caches of one spec can share a batch")
        if not other.started:
            raise ValueError("a cache must be prefilled before it joins a batch")
        if not self.started:
            self._adopt(other)
            return
        length = max(self.valid.shape[-1], other.valid.shape[-1])
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.append_rows(theirs)
        self.valid = torch.cat([left_pad(c.valid, length, False) for c in (self, other)])
        names = self.buffers.keys() | other.buffers.keys()
        self.buffers = {
            name: torch.cat([left_pad(c.buffers[name], length, 0) for c in (self, other)], dim=1)
            for name in names
        }
        self.prompt_len = torch.cat([self.prompt_len, other.prompt_len])
        self.seen = torch.cat([self.seen, other.seen])
        self.state = cat_rows([self.state, other.state])
        for name in _BOOKS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.has_holes = min(self.held) < length

    def prefix(self, length: int) -> BudgetedCache:
        """A new one-row cache (same hooks) holding this cache's first ``length`` slots, for a row that
        evicted nothing under a stateless policy (the full cache): a shared prompt prefix. The slots
        are views; later updates concatenate, so this cache is never written through them."""
        if self.batch_size != 1 or self.row_compactions[0] or self.state is not None or self.buffers:
            raise ValueError(
                "only a one-row cache that evicted nothing, without policy state, can be a prefix"
            )
        if not 0 < length <= self.held[0] or self.has_holes:
            raise ValueError(f"prefix length must be in 1..{self.held[0]}, got {length}")
        new = BudgetedCache(self.spec, self.model)
        new.owner, new.project_queries = self.owner, self.project_queries
        for mine, theirs in zip(new.layers, self.layers, strict=True):
            mine.lazy_initialization(theirs.keys, theirs.values)
            mine.keys, mine.values = theirs.keys[:, :, :length], theirs.values[:, :, :length]
            mine.positions = theirs.positions[:, :, :length]
        new.valid = self.valid[:, :length]
        new.prompt_len = torch.full_like(self.prompt_len, length)
        new.seen = torch.full_like(self.seen, length)
        new.state = None
        new.held, new.peak, new.since = [length], [length], [self.interval]
        new.budgets, new.evicted, new.row_compactions = [new.budget], [0], [0]
        new.held_sum, new.passes = [0], [0]
        return new

    def _adopt(self, other: BudgetedCache) -> None:
        self.layers = other.layers
        for name in ("valid", "buffers", "prompt_len", "seen", "state", "has_holes", *_BOOKS):
            setattr(self, name, getattr(other, name))

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> list[SequenceStats]:
        seen = self.seen.tolist()
        mean = [s / n if n else None for s, n in zip(self.held_sum, self.passes, strict=True)]
        rows = zip(self.prompt_len.tolist(), seen, self.peak, self.held, self.evicted, mean, strict=True)
        return [SequenceStats(*row) for row in rows]
