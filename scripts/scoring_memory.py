"""The vLLM plugin's scoring memory at a realistic shape: one Seg-Q compaction, before and after the
bounded reads (issue 57 item 4).

One compaction of the plugin (``epikv.vllm.compaction.compact``: Seg-Q's score over a ``PagedView``,
the keep rule, the hole-filling move) on a paged bf16 pool shaped like Llama-3-8B's (8 KV heads of 128
dims, 32 query heads, hidden 4096, blocks of 16): 16 rows due at once, each holding K + tau tokens.
Seg-Q reads every evicting layer's key variance (its tiers) and its query layer's keys (the
relevance). Each shape is measured twice, each in a fresh process: with epikv from this checkout, and
with epikv's ``src`` from git revision ``--before`` (``git archive``). Two numbers each:
- ``peak_allocated_bytes``: the most bytes of CPU tensors the compaction held at once, beyond the
  pool (torch's profiler, every allocation and free; exact);
- ``rss_extra_bytes``: the kernel's resident high-water mark during the compaction minus the resident
  set just before it (includes what the allocator keeps).
The pool, the slot store and the policy's state, made before the measurement, are in neither. The
scoring's extra memory is per layer, so the number of layers changes the pool, not it: K = 4,096 runs
at 4 layers to fit this machine. Writes ``results/vllm/scoring_memory.json``.

    .venv/bin/python scripts/scoring_memory.py [--before 997065a]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results/vllm/scoring_memory.json"
MODEL = {"kv_heads": 8, "heads": 32, "head_dim": 128, "hidden": 4096, "block": 16, "rows": 16, "tau": 128}
SHAPES = [{"layers": 32, "budget": 1024}, {"layers": 4, "budget": 4096}]


def measure(layers: int, budget: int) -> dict[str, Any]:
    """One Seg-Q compaction at MODEL with ``layers`` layers and K = ``budget``, with whatever epikv is
    importable (this checkout, or the revision the parent put first on the path)."""
    from epikv.bench.shared import machine
    from epikv.policies.base import ModelInfo
    from epikv.spec import CacheSpec
    from epikv.vllm.compaction import PagedView, SlotStore, compact
    from epikv.vllm.paged import PagedKV, PageLayout

    m = MODEL
    h, d, b, rows, hq = m["kv_heads"], m["head_dim"], m["block"], m["rows"], m["heads"]
    held = budget + m["tau"]
    per_row = -(-held // b)
    blocks = rows * per_row
    torch.manual_seed(0)
    pool = torch.empty(layers * blocks * h * b * 2 * d, dtype=torch.bfloat16)
    for part in pool.split(1 << 24):  # touch every page, in pieces (no pool-sized temporary)
        part.normal_()
    views = [page.view(blocks, h, b, 2 * d) for page in pool.chunk(layers)]
    tokens, dims = torch.arange(b)[:, None] * d, torch.arange(d)[None, :]
    paged = PagedKV(views, PageLayout(tokens + dims, b * d + tokens + dims))
    model = ModelInfo("llama-8b-like", layers, hq, h, d, m["hidden"])
    bands = {"band_a": layers // 3, "band_b": 2 * layers // 3}
    spec = CacheSpec.build(model, "epikv", budget, params=bands)
    slots = torch.arange(blocks * b).view(rows, per_row * b)[:, :held]
    prompt = 64
    queries = torch.randn(rows, hq, spec.policy.query_window, d)

    def fresh() -> tuple[Any, Any, PagedView]:
        store = SlotStore(paged, spec, model, blocks * b)
        store.project_queries = lambda layer, hidden, positions: queries
        for row in slots:
            store.write(row, torch.arange(held))
            store.write_buffer("epiphany", row, torch.rand(1, held, 1))
        state = spec.policy.init_state(rows, model, torch.device("cpu"))
        recent = state.extra
        recent.count.fill_(spec.policy.query_window)
        recent.positions.copy_(torch.arange(held - recent.positions.shape[1], held).expand(rows, -1))
        n = torch.full((rows,), held)
        return store, state, PagedView(store, slots, n, torch.full((rows,), prompt), n, budget)

    store, state, view = fresh()
    reset = machine.reset_peak_rss()
    before = machine.current_rss()
    done = compact(store, spec, state, view)
    rss_extra = machine.peak_rss() - before
    assert done.kept == [budget] * rows, done.kept
    store, state, view = fresh()
    peak = machine.peak_allocated(lambda: compact(store, spec, state, view))
    return {
        "layers": layers,
        "budget": budget,
        "held_per_row": held,
        "pool_bytes": pool.numel() * pool.element_size(),
        "one_layer_keys_float32_bytes": rows * h * held * d * 4,
        "peak_allocated_bytes": peak,
        "rss_extra_bytes": rss_extra,
        "rss_high_water_reset": reset,  # False: the high-water mark counts from the process's start
    }


def source_at(revision: str, folder: Path) -> Path:
    """epikv's ``src`` at git ``revision``, unpacked under ``folder``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", revision, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder / "src"


def child(shape: dict[str, int], src: Path | None) -> dict[str, Any]:
    """:func:`measure` in a fresh process, with epikv from ``src`` (None: this checkout)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    run = subprocess.run(
        [sys.executable, __file__, "--measure", json.dumps(shape)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="997065a", help="git revision with the unbounded reads")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # in the child: the shape, as JSON
    args = parser.parse_args()
    if args.measure is not None:
        import epikv

        result = measure(**json.loads(args.measure))
        print("RESULT " + json.dumps({**result, "epikv_from": str(Path(epikv.__file__).parent)}))
        return
    from epikv.bench.shared import machine

    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        old = source_at(args.before, Path(tmp))
        for shape in SHAPES:
            for label, src in (("before", old), ("after", None)):
                runs[label].append(child(shape, src))
                print(label, runs[label][-1], flush=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "what": "peak extra memory of one plugin Seg-Q compaction (bf16 paged pool), before/after",
        "model": MODEL,
        "shapes": SHAPES,
        "before_revision": args.before,
        "commit": head.stdout.strip(),
        "lscpu_model_name": machine.cpu()["model"],  # /proc/cpuinfo, as lscpu reads it
        "cpu_flags": machine.cpu()["flags"],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **runs,
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
