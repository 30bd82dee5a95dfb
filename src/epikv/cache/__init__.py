"""The budgeted KV cache (see :mod:`epikv.cache.budgeted`): the preallocated KV arena, which alone
writes and moves slots and rows (``arena``), a cache layer over it in transformers' contract
(``layer``), the per-row books (``books``), the cache that owns budgets, rows and compaction
(``budgeted``), the rings of sliding-window layers (``window``), and what policies and users read
from it (``view``)."""

from epikv.cache.arena import Arena, ArenaShape
from epikv.cache.books import RowBooks
from epikv.cache.budgeted import BudgetedCache, QueryProjector
from epikv.cache.layer import BudgetedLayer
from epikv.cache.view import SequenceStats, SlotView
from epikv.cache.window import WindowLayer, Windows

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
