"""The vLLM plugin's compaction memory at a realistic shape, before and after the bounded move.

One compaction of the plugin (``epikv.vllm.compaction.compact``: a ``streaming`` view, the keep rule,
the hole-filling move) on a paged bf16 pool shaped like Llama-3-8B's (32 layers, 8 KV heads of 128
dims, blocks of 16): 16 rows, each holding K + tau = 1024 + 128 tokens, so 16 x 128 tokens move in
every layer. Measured twice, each in a fresh process: with ``PagedKV`` from this checkout, and with it
loaded from git revision ``--before`` (the one-shot gather). Two numbers each:
- ``peak_allocated_bytes``: the most bytes of CPU tensors the compaction held at once, beyond the
  pool (torch's profiler, every allocation and free; exact);
- ``rss_extra_bytes``: the kernel's resident high-water mark during the compaction minus the resident
  set just before it (VmHWM reset, then read; includes what the allocator keeps).
The pool, filled before the measurement, is in neither. Also ``move_only_peak_allocated_bytes``:
``PagedKV.move`` alone on the same pairs. Writes ``results/vllm/move_memory.json``.

    .venv/bin/python scripts/move_memory.py [--before fc9f75b]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from epikv.bench.shared import machine
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results/vllm/move_memory.json"
SHAPE = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block": 16, "rows": 16, "budget": 1024, "tau": 128}


def load_paged(revision: str | None) -> Any:
    """``epikv.vllm.paged`` from this checkout, or its source at git ``revision``."""
    if revision is None:
        import epikv.vllm.paged as paged

        return paged
    source = subprocess.run(
        ["git", "show", f"{revision}:src/epikv/vllm/paged.py"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("paged_at_revision", f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(revision: str | None) -> dict[str, Any]:
    """One compaction and one bare move at SHAPE, with ``PagedKV`` at ``revision`` (None: this one)."""
    from epikv.vllm.compaction import PagedView, SlotStore, compact

    paged_module = load_paged(revision)
    s = SHAPE
    layers, h, d, b, rows = s["layers"], s["kv_heads"], s["head_dim"], s["block"], s["rows"]
    held = s["budget"] + s["tau"]
    per_row = -(-held // b)
    blocks = rows * per_row
    pool = torch.empty(layers * blocks * h * b * 2 * d, dtype=torch.bfloat16)
    for part in pool.split(1 << 24):  # touch every page, in pieces (no pool-sized temporary)
        part.normal_()
    views = [page.view(blocks, h, b, 2 * d) for page in pool.chunk(layers)]
    # a row-major page: a key's dims, then (after the block's keys) its value's; memory does not
    # depend on the layout, which only decides where inside a page each element goes
    tokens, dims = torch.arange(b)[:, None] * d, torch.arange(d)[None, :]
    paged = paged_module.PagedKV(views, paged_module.PageLayout(tokens + dims, b * d + tokens + dims))
    model = ModelInfo("llama-8b-like", layers, 4 * h, h, d, 4 * h * d)
    spec = CacheSpec.build(model, "streaming", s["budget"], interval=s["tau"])
    store = SlotStore(paged, spec, model, blocks * b)
    slots = torch.arange(blocks * b).view(rows, per_row * b)[:, :held]
    for row in slots:
        store.write(row, torch.arange(held))
    n = torch.full((rows,), held)
    view = PagedView(store, slots, n, torch.full((rows,), 16), n, s["budget"])
    reset = machine.reset_peak_rss()
    before = machine.current_rss()
    done = compact(store, spec, None, view)
    rss_extra = machine.peak_rss() - before
    moved = held - done.kept[0]
    assert done.kept == [s["budget"]] * rows and moved == s["tau"]
    # what compact moved: in each row, the kept tokens at slots >= K fill the evicted slots 4..4+tau-1
    src = slots[:, s["budget"] :].reshape(-1)
    dst = slots[:, 4 : 4 + moved].reshape(-1)
    # compact again on a fresh view (same pool, same work), now counting every allocation
    store = SlotStore(paged, spec, model, blocks * b)
    for row in slots:
        store.write(row, torch.arange(held))
    view = PagedView(store, slots, n, torch.full((rows,), 16), n, s["budget"])
    peak = machine.peak_allocated(lambda: compact(store, spec, None, view))
    move_peak = machine.peak_allocated(lambda: paged.move(src, dst, None, None))
    return {
        "paged_from": revision or "this checkout",
        "pairs_moved": int(src.numel()),
        "pool_bytes": pool.numel() * pool.element_size(),
        "peak_allocated_bytes": peak,
        "rss_extra_bytes": rss_extra,
        "rss_high_water_reset": reset,  # False: the high-water mark counts from the process's start
        "move_only_peak_allocated_bytes": move_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="fc9f75b", help="git revision with the one-shot gather")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # in the child: a revision, or "."
    args = parser.parse_args()
    if args.measure is not None:
        print("RESULT " + json.dumps(measure(None if args.measure == "." else args.measure)))
        return
    runs = {}
    for label, revision in (("before", args.before), ("after", ".")):
        child = subprocess.run(
            [sys.executable, __file__, "--measure", revision], capture_output=True, text=True, check=True
        )
        line = next(x for x in child.stdout.splitlines() if x.startswith("RESULT "))
        runs[label] = json.loads(line[len("RESULT ") :])
        print(label, runs[label])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "what": "peak extra memory of one plugin compaction (streaming, bf16 paged pool), before/after",
        "shape": SHAPE,
        "commit": head.stdout.strip(),
        "lscpu_model_name": machine.cpu()["model"],  # /proc/cpuinfo, as lscpu reads it
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **runs,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
