"""Benchmarks of the paper's systems claims, runnable on any machine (``epikv bench <kind>``).

One module per kind, each with a config dataclass (and a ``QUICK`` preset), a ``run_<kind>``
function that accepts an in-process model where it can and returns a result document, and a
``plot_<kind>`` function that draws from the written JSON alone:

* :mod:`~epikv.bench.memory`: peak memory of one forward pass vs length, three paths (Fig. 1);
* :mod:`~epikv.bench.speed`: decode tokens/s and per-step time vs position per policy;
* :mod:`~epikv.bench.fidelity`: agreement with the full cache on teacher-forced and free traces;
* :mod:`~epikv.bench.capacity`: concurrent requests per accelerator, with and without K (Fig. 6);
* :mod:`~epikv.bench.peer`: against NVIDIA kvpress's decoding-time compression.

:mod:`~epikv.bench.documents` (result files), :mod:`~epikv.bench.machine` (machine facts, memory
probes), :mod:`~epikv.bench.model_loading`, :mod:`~epikv.bench.prompt_loading` and
:mod:`~epikv.bench.figures` hold what they share;
:mod:`~epikv.bench.genres` the text genres of the fidelity study (prompts and forced continuations)
and :mod:`~epikv.bench.stats` its statistics (bootstrap intervals, equal-peak budgets, histograms).
"""

from epikv.bench.documents import read_result, write_result

__all__ = ["read_result", "write_result"]
