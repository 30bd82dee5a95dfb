"""One request's counters, named: what the worker reports after each step it ran the request in
(:meth:`epikv.vllm.step.EpiKVWorkerState.take`), what rides to the scheduler on the runner's output
(pickled), and what each of the request's outputs carries as ``kv_transfer_params["epikv"]``. Imports
nothing of vLLM."""

from __future__ import annotations

from typing import NamedTuple


class Counters(NamedTuple):
    """peak_cache_tokens: the most tokens the request held; evictions: tokens evicted so far;
    compactions: compactions so far; budget: the K it runs at (None: it never evicts)."""

    peak_cache_tokens: int
    evictions: int
    compactions: int
    budget: int | None

    def as_params(self) -> dict[str, int | None]:
        """The counters as the request's outputs carry them (``kv_transfer_params["epikv"]``)."""
        return {name: None if v is None else int(v) for name, v in self._asdict().items()}
