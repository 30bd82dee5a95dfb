"""The machine and process a benchmark measures on: facts for the result, memory probes, threads.

Owns what goes under a result's ``machine`` key (host, library versions, threads, load, accelerator),
the process-level memory probes (resident set now and at its peak on Linux, read from ``/proc``,
with ``ru_maxrss`` where there is none), the allocator settings for measured subprocesses, and the
device synchronizer that timings wait on. It knows no benchmark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# glibc settings for measured subprocesses: a fixed mmap threshold sends every large tensor to its
# own mapping, returned to the system when freed, so resident memory follows live tensors instead of
# the allocator's history (without it, repeated runs of one point differed by 30%).
QUIET_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}


def load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (None where the OS has none): record it with timings."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu() -> dict[str, Any]:
    """The CPU's model name and the vector flags that decide fp32/bf16 speed (from /proc/cpuinfo):
    recorded beside every timing, since the project's machines differ in them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "flags": []}
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return {"model": model, "flags": [f for f in SPEED_FLAGS if f in flags]}


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: host, library versions, threads, load, accelerator."""
    import numpy
    import transformers

    import epikv

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "memory_total_bytes": _proc_bytes("/proc/meminfo", "MemTotal"),
        "python": platform.python_version(),
        "versions": {
            "epikv": epikv.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": numpy.__version__,
        },
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info["accelerator"] = {"name": props.name, "memory_bytes": props.total_memory}
    return info


def _proc_bytes(path: str, key: str) -> int | None:
    """The ``key:  N kB`` line of a /proc file, in bytes (None where the file or line is missing)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _status_or_max_rss(key: str) -> int:
    """This process's ``key`` from /proc/self/status, else the peak resident set (ru_maxrss)."""
    value = _proc_bytes("/proc/self/status", key)
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """Resident set size now, in bytes (VmRSS; ru_maxrss where /proc is missing)."""
    return _status_or_max_rss("VmRSS")


def reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) to the current RSS; False if unsupported.
    The C heap's free pages go back to the system first (glibc's ``malloc_trim``): in a process that
    has freed large buffers they stay resident, and new buffers placed in them would not raise RSS,
    so a peak measured from here would miss them."""
    _trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _trim_heap() -> None:
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def peak_rss() -> int:
    """Peak resident set since the last reset (VmHWM), else since the process started (ru_maxrss)."""
    return _status_or_max_rss("VmHWM")


def peak_allocated(run: Callable[[], object]) -> int:
    """The most bytes of CPU tensor memory that ``run`` held allocated at once, counting only what it
    allocated itself (torch's profiler records every allocation and free of the CPU allocator, in
    order). Exact and deterministic, unlike resident memory; raises if the profiler saw nothing, so a
    probe that stopped working cannot read as zero."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, fields.alloc_size))
        stack.extend(node.children)
    if not events:
        raise RuntimeError("the profiler recorded no allocation")
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def virtual_size() -> int | None:
    return _proc_bytes("/proc/self/status", "VmSize")


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    """A function that waits for queued work on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
