"""The host-neutral core (run spec, selection, scoring, policies, books, profiles, the query path)
and the vLLM plugin's modules import and run with transformers, ``epikv.integration``,
``epikv.engine``, ``epikv.cache.budgeted`` and ``epikv.models`` blocked: inside vLLM's environment
they are all the plugin loads of epikv, on its real paths (Seg-Q with shipped bands, the
Transformers backend's query path). Run in a fresh interpreter, so nothing imported earlier hides
an import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = (
    "transformers", "epikv.integration", "epikv.engine", "epikv.cache.budgeted", "epikv.models", "vllm",
)  # fmt: skip
CORE = (
    "epikv.spec",
    "epikv.archs",
    "epikv.selection",
    "epikv.scoring",
    "epikv.policies",
    "epikv.cache.books",
    "epikv.profiles",
    "epikv.vllm",
    "epikv.vllm.config",
    "epikv.vllm.pins",
    "epikv.vllm.requests",
    "epikv.vllm.step",
    "epikv.vllm.compaction",
    "epikv.vllm.counters",
    "epikv.vllm.paged",
    "epikv.vllm.metrics",
    "epikv.vllm.queries",
    "epikv.querypath",
    "epikv.paths",
)

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, sys
    blocked = {blocked!r}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in blocked):
                raise ImportError(f"blocked: {{name}}")
    sys.meta_path.insert(0, Block())
    for name in {core!r}:
        importlib.import_module(name)
    from epikv.policies.base import ModelInfo
    from epikv.vllm.config import EpiKVSettings, plan_request
    spec = EpiKVSettings("epikv", 256, params={{"band_a": 10, "band_b": 20}}).spec(
        ModelInfo("m", 30, 9, 3, 64, 576)
    )
    # the plugin's real paths: Seg-Q with the shipped bands (found through the user's profile folder
    # first), and the Transformers-backend query path, which resolves its imports when built
    shipped = EpiKVSettings("epikv", 256).spec(ModelInfo("smollm2-135m", 30, 9, 3, 64, 576))
    assert shipped.bands.band_a == 7 and "shipped" in shipped.bands.origin, shipped.bands
    from types import SimpleNamespace
    from epikv.vllm.queries import _transformers_backend
    _transformers_backend(SimpleNamespace(model=None), "llama")
    print(plan_request(spec, 100, 50, None))
    """
)


def test_the_core_imports_and_plans_a_request_without_transformers_or_the_engine():
    script = SCRIPT.format(blocked=BLOCKED, core=CORE)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "RequestPlan(budget=256, cap=384, reserve=150)"


def test_the_guard_would_catch_a_blocked_import():
    script = SCRIPT.format(blocked=BLOCKED, core=("epikv.cache.budgeted",))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "blocked: epikv.cache.budgeted" in done.stderr
