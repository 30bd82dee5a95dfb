"""Memory benchmark: one point per path in process, the stop-at-first-failure sweep, a capped worker."""

from __future__ import annotations

import json

import pytest
import torch

from epikv.bench.memory import study as memory
from epikv.bench.memory.study import MemoryConfig
from epikv.bench.shared import documents
from epikv.cli import main


def test_attention_outputs_cost_more_than_sdpa(tiny_pair):
    """Also in a process whose heap holds freed buffers (a long test session, a sweep in process):
    new buffers placed there would not raise the resident peak unless the heap is trimmed first."""
    model, _ = tiny_pair
    for _ in range(3):  # freed, still resident: about 16 MiB of maps could fit in them
        churn = [torch.randn(1024, 1024) for _ in range(64)], [torch.randn(4, 512, 512) for _ in range(40)]
        del churn
    points = {path: memory.measure_point(model, path, 512, "cpu") for path in memory.PATHS}
    assert all(p["status"] == "ok" and p["source"] == "VmHWM" for p in points.values())
    # 4 layers x 4 heads x 512^2 float32 attention maps alone are 16 MiB
    assert points["attention_outputs"]["peak_bytes"] > points["sdpa"]["peak_bytes"] + 12 * 2**20
    assert model.config._attn_implementation == "sdpa"  # the eager switch was undone
    spec = points["epikv_capture"]["cache_spec"]  # the capture's bands and where they came from
    assert spec["policy"]["name"] == "epikv-flat" and spec["bands"]["origin"].startswith("scaled")
    assert "cache_spec" not in points["sdpa"]


def test_sweep_stops_at_first_failure_and_summarises():
    def fake(path: str, length: int) -> dict:
        limit = {"attention_outputs": 256, "sdpa": 10**9, "epikv_capture": 10**9}[path]
        if length > limit:
            return {"path": path, "length": length, "status": "oom"}
        extra = 10 if path == "epikv_capture" else 0
        point = {
            "path": path,
            "length": length,
            "status": "ok",
            "peak_bytes": 100 + extra,
            "peak_total_bytes": 1000 + extra,
        }
        return {**point, "cache_spec": {"describe": "policy=epikv-flat"}} if extra else point

    config = MemoryConfig(min_length=128, max_length=1024)
    doc = memory.run_memory(config, runner=fake)
    statuses = [p["status"] for p in doc["results"]["points"] if p["path"] == "attention_outputs"]
    assert statuses == ["ok", "ok", "oom", "skipped"]
    summary = doc["results"]["summary"]
    assert summary["paths"]["attention_outputs"]["max_ok_length"] == 256
    assert summary["feasible_ratio"]["sdpa/attention_outputs"] == {"ratio": 4.0, "lower_bound": True}
    assert summary["capture_overhead"][0] == {"length": 128, "resident_pct": 10.0, "total_pct": 1.0}
    assert doc["config"]["cache_specs"] == [{"describe": "policy=epikv-flat"}]  # once, not per point
    assert not any("cache_spec" in p for p in doc["results"]["points"])


def test_worker_output_parsing():
    assert memory.parse_worker_output("sdpa", 8, 0, 'noise\n{"status": "ok"}\n', "")["status"] == "ok"
    assert memory.parse_worker_output("sdpa", 8, -9, "", "")["status"] == "killed"
    assert memory.parse_worker_output("sdpa", 8, 1, "", "Traceback")["status"] == "crashed"


def test_cli_finds_the_boundary_in_a_capped_subprocess(tmp_path, capsys):
    # eager 4096 tokens: 4 layers x 4 heads x 4096^2 x 4 bytes = 1 GiB of maps, above a 0.3 GB cap
    code = main(
        [
            "bench",
            "memory",
            "--quick",
            "--model",
            "random:tiny-llama",
            "--paths",
            "attention_outputs",
            "--min-length",
            "4096",
            "--max-length",
            "8192",
            "--cap-gb",
            "0.3",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = documents.read_result(tmp_path / "memory.json", "memory")
    assert [p["status"] for p in data["results"]["points"]] == ["oom", "skipped"]
    err = capsys.readouterr().err
    assert "bench memory: 100%" in err and "2/2" in err  # the failed point and the one it skipped
    assert data["results"]["points"][0]["address_space_limit"] > 0
    assert (tmp_path / "memory.png").stat().st_size > 5000


def test_plot_reads_only_the_file(tmp_path):
    doc = memory.run_memory(
        MemoryConfig(min_length=64, max_length=128),
        runner=lambda p, n: {
            "path": p,
            "length": n,
            "status": "ok",
            "peak_bytes": n * 1000,
            "peak_total_bytes": n * 2000,
        },
    )
    path = documents.write_result(doc, tmp_path)
    json.loads(path.read_text())
    assert memory.plot_memory(path, tmp_path / "again.png").stat().st_size > 5000


def test_config_validation():
    with pytest.raises(ValueError, match="unknown memory path"):
        MemoryConfig(paths=("flash",))
    assert MemoryConfig(min_length=256, max_length=2048).lengths == [256, 512, 1024, 2048]
