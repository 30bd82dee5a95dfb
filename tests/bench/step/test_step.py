"""bench step on a tiny model: every cell measured, the traffic bound computed by hand, the arena's
bytes, the document, the figure and the table."""

from __future__ import annotations

import pytest
import torch

from epikv.bench.step import study as step
from epikv.bench.step.study import StepConfig
from epikv.cli import main
from epikv.models.tiny import tiny_model


@pytest.fixture(scope="module")
def step_doc():
    config = StepConfig(batches=(1, 3), contexts=(200,), dtypes=("float32",), tokens=2, warmup=1)
    return step.run_step(config, tiny_model("llama", 0, identity="tiny-llama"))


def test_every_cell_is_measured_against_its_bound(step_doc):
    results = step_doc["results"]
    cells = results["cells"]
    assert [(c["policy"], c["batch"]) for c in cells] == [
        ("full", 1),
        ("full", 3),
        ("epikv", 1),
        ("epikv", 3),
    ]
    model = tiny_model("llama", 0)
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    weights = sum(p.numel() * 4 for p in model.parameters())
    for cell in cells:
        assert cell["traffic_bytes"] == weights + cell["batch"] * 200 * per_token
        expected = 1e3 * cell["traffic_bytes"] / results["bandwidth_bytes_per_s"]
        assert cell["bound_ms"] == pytest.approx(expected)
        assert cell["ratio"] == pytest.approx(cell["step_ms"] / cell["bound_ms"])
        assert len(cell["step_ms_all"]) == 2 and cell["step_ms"] > 0
    full, epikv = cells[1], cells[3]
    assert full["cached_tokens"] == 199 + 3  # the source row, then warmup + measured steps
    assert full["compact_ms"] is None and epikv["compact_ms"] > 0
    assert epikv["budget"] == 200 - 128 and epikv["interval"] == 128
    assert epikv["kv_bytes_allocated"] >= 3 * 202 * per_token  # every row's slots are allocated


def test_plot_and_table(step_doc, tmp_path):
    from epikv.bench.shared import documents

    path = documents.write_result(step_doc, tmp_path)
    assert step.plot_step(path).stat().st_size > 5000
    table = step.markdown(step_doc)
    assert table.count("\n") == 1 + 4 and "| float32 | epikv | 200 | 3 |" in table


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="dtype 'float8'"):
        StepConfig(dtypes=("float8",))
    with pytest.raises(ValueError, match="contexts"):
        StepConfig(contexts=(10,))


def test_cli_quick_on_a_random_model(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "step"
    argv = ["bench", "step", "--model", "random:tiny-llama", "--batches", "1", "--contexts", "200"]
    assert main([*argv, "--dtypes", "float32", "--tokens", "1", "--out", str(out), "--no-progress"]) == 0
    assert (out / "step.json").exists() and (out / "step.png").exists()
