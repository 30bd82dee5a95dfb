"""Capacity arithmetic against the paper's Fig. 6 numbers, and its document and figure."""

from __future__ import annotations

import json

import pytest

from epikv.bench.capacity import study as capacity
from epikv.bench.capacity.study import CapacityConfig, KVShape
from epikv.bench.shared import documents


def test_paper_numbers():
    doc = capacity.run_capacity(CapacityConfig())  # Llama-8B bf16, 80 GB, u = 0.9, W = 16 GB
    results = doc["results"]
    assert results["kv_bytes_per_token"] == 128 * 1024
    assert results["kv_pool_tokens"] == pytest.approx(458752)
    assert [row["full"] for row in results["rows"]] == [112, 56, 28, 14, 7, 3]
    assert {row["K=2048"] for row in results["rows"]} == {224}
    assert {row["K=4096"] for row in results["rows"]} == {112}


def test_budget_above_context_holds_the_context_and_slack_costs_requests():
    shape = KVShape(layers=32, kv_heads=8, head_dim=128, parameters=0)
    table = capacity.capacity_table(shape, CapacityConfig(contexts=(1024,), budgets=(2048,)))
    assert table["rows"][0]["K=2048"] == table["rows"][0]["full"] == 448
    slack = capacity.capacity_table(shape, CapacityConfig(contexts=(8192,), budgets=(2048,), slack=128))
    assert slack["rows"][0]["K=2048"] == 458752 // (2048 + 128)


def test_weights_default_to_parameter_bytes():
    config = capacity.load_config("llama-8b")
    assert capacity.estimate_parameters(config) == pytest.approx(8.03e9, rel=0.01)
    table = capacity.capacity_table(capacity.shape_from_config(config), CapacityConfig(weights_gb=None))
    assert table["weights_bytes"] == capacity.estimate_parameters(config) * 2


def test_bad_assumptions_are_rejected():
    with pytest.raises(ValueError, match="usable"):
        CapacityConfig(usable=1.5)
    assert capacity.max_requests(10, 0.9, 100, 4096, 1) == 0


def test_document_and_plot_from_file(tmp_path):
    path = documents.write_result(capacity.run_capacity(CapacityConfig(model="qwen-1.5b")), tmp_path)
    data = json.loads(path.read_text())
    assert set(documents.TOP_LEVEL_KEYS) <= set(data)
    assert data["config"]["model"] == "qwen-1.5b"
    assert data["results"]["kv_bytes_per_token"] == 2 * 28 * 2 * 128 * 2
    png = capacity.plot_capacity(path)
    assert png.stat().st_size > 5000
