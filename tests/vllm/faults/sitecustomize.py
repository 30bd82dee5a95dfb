"""Loaded first by every Python process of a test server whose ``PYTHONPATH`` starts here
(``engines.serve(..., faults=True)``): a request whose own ``epikv_budget`` is :data:`FAULT_BUDGET`
fails in its prefill inside the worker, as a bug in a policy would fail it, so the server's answer to
a request the plugin failed can be tested over HTTP (``tests/vllm/test_serve.py``). Every other
request runs untouched. The patch is applied when ``epikv.vllm.step`` is first imported, so nothing
is imported early here."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

FAULT_BUDGET = 77
TARGET = "epikv.vllm.step"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module.EpiKVWorkerState)

        spec.loader.exec_module = exec_module
        return spec


def _patch(state: type) -> None:
    prefill = state._prefill

    def failing_prefill(self: Any, req_id: str, *args: Any) -> Any:
        if self.requests.records[req_id].books.budgets[0] == FAULT_BUDGET:
            raise RuntimeError("a fault for the test")
        return prefill(self, req_id, *args)

    state._prefill = failing_prefill


sys.meta_path.insert(0, _PatchOnImport())
