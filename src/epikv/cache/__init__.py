"""The budgeted KV cache (see :mod:`epikv.cache.budgeted`): a cache layer that keeps true positions
(``layer``), the cache that owns budgets, per-row books and compaction (``budgeted``), and what
policies and users read from it (``view``)."""

from epikv.cache.budgeted import BudgetedCache, QueryProjector
from epikv.cache.layer import BudgetedLayer
from epikv.cache.view import CacheView, SequenceStats

__all__ = ["BudgetedCache", "BudgetedLayer", "CacheView", "QueryProjector", "SequenceStats"]
