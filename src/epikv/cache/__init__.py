"""The budgeted KV cache (see :mod:`epikv.cache.budgeted`): the preallocated KV arena, which alone
writes and moves slots and rows (``arena``), a cache layer over it in transformers' contract
(``layer``), the per-row books (``books``), the cache that owns budgets, rows and compaction
(``budgeted``), the rings of sliding-window layers (``window``), and what policies and users read
from it (``view``).

The names below are imported when first used, so ``epikv.cache.books`` and ``epikv.cache.view``
(host-neutral: the vLLM plugin keeps its books with them) load without transformers' cache code.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epikv.cache.arena import Arena, ArenaShape
    from epikv.cache.books import RowBooks
    from epikv.cache.budgeted import BudgetedCache, QueryProjector
    from epikv.cache.layer import BudgetedLayer
    from epikv.cache.view import SequenceStats, SlotView
    from epikv.cache.window import WindowLayer, Windows

_LAZY = {
    "Arena": "arena",
    "ArenaShape": "arena",
    "RowBooks": "books",
    "BudgetedCache": "budgeted",
    "QueryProjector": "budgeted",
    "BudgetedLayer": "layer",
    "SequenceStats": "view",
    "SlotView": "view",
    "WindowLayer": "window",
    "Windows": "window",
}

__all__ = [
    "Arena",
    "ArenaShape",
    "BudgetedCache",
    "BudgetedLayer",
    "QueryProjector",
    "RowBooks",
    "SequenceStats",
    "SlotView",
    "WindowLayer",
    "Windows",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f"epikv.cache.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epikv.cache' has no attribute {name!r}")
