"""Benchmarks of the paper's systems claims and the studies of what eviction costs
(``epikv bench <kind>``), one folder per study:

* :mod:`~epikv.bench.memory`: peak memory of one forward pass vs length, three paths (Fig. 1);
* :mod:`~epikv.bench.speed`: decode tokens/s and per-step time vs position per policy;
* :mod:`~epikv.bench.step`: the decode step against the memory-traffic bound;
* :mod:`~epikv.bench.fidelity`: agreement with the full cache on teacher-forced and free traces;
* :mod:`~epikv.bench.loops`: free-running loops, cap hits and accuracy at equal peak memory;
* :mod:`~epikv.bench.capacity`: concurrent requests per accelerator, with and without K (Fig. 6);
* :mod:`~epikv.bench.peer`: against NVIDIA kvpress's decoding-time compression;
* :mod:`~epikv.bench.serve`: ``epikv serve`` under concurrent clients.

Each study's ``study`` module has a config dataclass (and a ``QUICK`` preset), a ``run_<kind>``
function that accepts an in-process model where it can and returns a result document, and a
``plot_<kind>`` function that draws from the written JSON alone; :mod:`~epikv.bench.cli` turns
flags into that config. :mod:`~epikv.bench.shared` holds what the studies share.
"""

from epikv.bench.shared.documents import read_result, write_result

__all__ = ["read_result", "write_result"]
