"""How many CPU threads torch uses for a command: one rule for ``generate``, ``eval`` and ``serve``.

Measured here (``scripts/thread_defaults.py``, ``results/threads.json``; the table is in
``docs/benchmarks.md``): on an idle 2-core machine two threads decode about 1.7x faster than one,
but with one other busy process beside it two threads decode about 2.4x *slower* than one (the
threads wait on each other while one of them is descheduled). So the default, ``auto``, gives torch
the cores nobody else is using when the command starts: cores minus the 1-minute load average,
rounded, at least one. A number sets the threads outright. The choice and its reason are printed
and recorded by the command (:func:`apply_threads` returns the line).
"""

from __future__ import annotations

import os

AUTO = "auto"
THREADS_HELP = "torch CPU threads: a number, or auto (default) = the cores not busy at start"


def parse_threads(value: str | int | None) -> int | None:
    """``auto`` (or None) -> None; a positive number of threads -> that number; anything else is an
    error naming the value."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--threads must be 'auto' or a positive number of threads, got {value!r}")
    return int(text)


def auto_threads(cores: int, load: float) -> int:
    """The cores not busy: ``cores - round(load)``, at least 1 and at most ``cores``."""
    return max(1, min(cores, cores - round(load)))


def apply_threads(value: str | int | None) -> str:
    """Set torch's intra-op threads by the rule above; returns one line saying what and why."""
    import torch

    asked = parse_threads(value)
    if asked is not None:
        torch.set_num_threads(asked)
        return f"threads {asked} (--threads)"
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0  # none reported: all cores
    chosen = auto_threads(cores, load)
    torch.set_num_threads(chosen)
    return f"threads {chosen} (auto: {cores} cores, load {load:.1f}; set --threads to choose)"
