"""A request's counters as one named record (issue 58 item 5): the fields in the order the worker
has always reported them, the keys its outputs carry, and a pickle round trip (they cross from the
worker's process to the scheduler's)."""

from __future__ import annotations

import pickle

import numpy as np

from epikv.vllm.counters import Counters


def test_the_record_reads_as_its_outputs_carry_it():
    counters = Counters(np.int64(300), np.int64(44), 2, 256)  # the worker's books hold numpy ints
    assert counters == (300, 44, 2, 256)  # the positional order of the tuple it replaces
    params = counters.as_params()
    assert params == {"peak_cache_tokens": 300, "evictions": 44, "compactions": 2, "budget": 256}
    assert all(type(v) is int for v in params.values())  # JSON-ready
    assert Counters(128, 0, 0, None).as_params()["budget"] is None


def test_the_record_crosses_processes():
    counters = Counters(300, 44, 2, None)
    again = pickle.loads(pickle.dumps({"req-1": counters}))["req-1"]
    assert type(again) is Counters and again == counters and again.evictions == 44


def test_the_workers_report_holds_counters_records():
    from epikv.policies.base import ModelInfo
    from epikv.vllm.config import EpiKVSettings
    from epikv.vllm.step import EpiKVWorkerState
    from tests.plugin_without_vllm.test_step import batch

    model = ModelInfo("m", 30, 9, 3, 64, 576)
    settings = EpiKVSettings("full")
    state = EpiKVWorkerState(settings, settings.spec(model), model)
    state.after_forward(batch("ab", [10, 4], [10, 4], [1, 1], [64, 64]), None)
    report, _ = state.take()
    assert report == {"a": (11, 0, 0, None), "b": (5, 0, 0, None)}
    assert all(type(c) is Counters for c in report.values())  # named, not a bare 4-tuple
