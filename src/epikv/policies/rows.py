"""Per-row policy state and the two operations the engine needs on it: take rows, concatenate rows.

The engine keeps one batch whose rows join (a new request, prefilled alone) and leave (a finished
one) between steps, so a policy's per-generation state must hold one entry per row and nothing that
assumes the rows step in lockstep. A state is a :class:`RowState` dataclass whose fields are per
row: a tensor with the batch on dim 0, a list with one entry per row, a nested ``RowState``, or None.
Fields named in ``shared`` are the same for every row (the model's shape) and come from the first
state. The cache splices rows with :func:`take_rows` and :func:`cat_rows` and never learns a
policy's type; a state whose per-row tensors can differ in their other dims overrides ``cat``.
A policy replaces a field (a new tensor, a new list) and never writes into one, so a state can be
restored after a call that raised (:func:`snapshot_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

import torch

S = TypeVar("S", bound="RowState")
R = TypeVar("R")


@dataclass
class RowState:
    """Base of policy states; see the module docstring for what a field may hold."""

    shared: ClassVar[tuple[str, ...]] = ()

    def take(self: S, index: Sequence[int]) -> S:
        """The state of rows ``index`` (in that order)."""
        names = [f.name for f in fields(self) if f.name not in self.shared]
        changes = {name: _take(getattr(self, name), index) for name in names}
        return replace(self, **changes)

    @classmethod
    def cat(cls: type[S], states: Sequence[S]) -> S:
        """The states of several batches stacked row-wise, in order."""
        first = states[0]
        changes = {
            f.name: _cat([getattr(s, f.name) for s in states], f.name)
            for f in fields(first)
            if f.name not in cls.shared
        }
        return replace(first, **changes)


def _take(value: Any, index: Sequence[int]) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(list(index), dtype=torch.long, device=value.device)]
    if isinstance(value, list):
        return [value[i] for i in index]
    if isinstance(value, RowState):
        return value.take(index)
    raise TypeError(f"a per-row state field holds {type(value).__name__}; use a tensor, list or RowState")


def _cat(values: list[Any], name: str) -> Any:
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError(f"state field {name!r} is set in some rows and unset in others")
    first = values[0]
    if isinstance(first, torch.Tensor):
        shapes = {tuple(v.shape[1:]) for v in values}
        if len(shapes) > 1:
            raise ValueError(f"state field {name!r} differs in shape between rows: {sorted(shapes)}")
        return torch.cat(values, dim=0)
    if isinstance(first, list):
        return [item for v in values for item in v]
    if isinstance(first, RowState):
        return type(first).cat(values)
    raise TypeError(f"a per-row state field holds {type(first).__name__}; use a tensor, list or RowState")


def take_rows(state: Any, index: Sequence[int]) -> Any:
    """Rows ``index`` of a policy state (None for a stateless policy)."""
    if state is None:
        return None
    if not isinstance(state, RowState):
        raise TypeError(f"policy state {type(state).__name__} is not a RowState; the engine cannot splice it")
    return state.take(index)


def snapshot_rows(state: Any) -> Any:
    """A copy of a policy state's structure (its ``RowState`` objects and lists are new; its tensors
    are shared): what the state was before a call that may replace some of its fields and then
    raise. Valid because a policy replaces a field's tensor and never writes into it."""
    if state is None:
        return None
    if not isinstance(state, RowState):
        raise TypeError(f"policy state {type(state).__name__} is not a RowState")
    return replace(state, **{f.name: _snapshot(getattr(state, f.name)) for f in fields(state)})


def _snapshot(value: Any) -> Any:
    if isinstance(value, RowState):
        return snapshot_rows(value)
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


def cat_rows(states: Sequence[Any]) -> Any:
    """Policy states of several batches stacked row-wise (None for a stateless policy)."""
    if all(s is None for s in states):
        return None
    if not all(isinstance(s, RowState) for s in states):
        kinds = sorted({type(s).__name__ for s in states})
        raise TypeError(f"cannot concatenate policy states of types {kinds}")
    return type(states[0]).cat(states)


def on_rows(state: Any, rows: Sequence[int], total: int, run: Callable[[Any], R]) -> tuple[R, Any]:
    """Run ``run`` on the state of rows ``rows`` of a batch of ``total`` rows and put that state back
    in place (scoring may advance it): returns (what ``run`` returned, the whole batch's state)."""
    if list(rows) == list(range(total)):
        return run(state), state
    part = take_rows(state, rows)
    result = run(part)
    others = [r for r in range(total) if r not in rows]
    merged = cat_rows([take_rows(state, others), part])
    order = others + list(rows)
    return result, take_rows(merged, sorted(range(total), key=order.__getitem__))


def pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` to ``size`` (for per-row tensors that grow, like ThinKV's)."""
    return torch.nn.functional.pad(x, (0, size - x.shape[-1]))
