"""One memory point in its own process: ``python -m epikv.bench.memory.worker --path P --length L``.

Loads the model, caps the process's address space ``--cap-gb`` above what the loaded model
occupies (so an allocation past it raises instead of swapping or waking the kernel's OOM killer),
runs :func:`epikv.bench.memory.study.measure_point` and prints one JSON line. It owns nothing else.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

from epikv.bench.memory.study import PATHS, measure_point
from epikv.bench.shared import machine, model_loading

GIB = 1 << 30


def cap_address_space(extra_bytes: int) -> int | None:
    """Limit the virtual address space to its current size plus ``extra_bytes``; returns the limit."""
    now = machine.virtual_size()
    if now is None:
        return None
    limit = now + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epikv.bench.memory.worker")
    parser.add_argument("--path", choices=PATHS, required=True)
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cap-gb", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--capture-policy", default="epikv-flat")
    args = parser.parse_args(argv)
    machine.set_threads(args.threads)
    model, _ = model_loading.load_bench_model(args.model, args.device, args.dtype)
    model_loading.page_in(model)
    limit = cap_address_space(int(args.cap_gb * GIB)) if args.cap_gb else None
    point = measure_point(model, args.path, args.length, args.device, args.capture_policy)
    point.update(model=model_loading.model_name(model), address_space_limit=limit)
    sys.stdout.write(json.dumps(point) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
