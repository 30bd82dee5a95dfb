"""``epikv eval --engine vllm`` (issue 41): the same run on vLLM with the plugin writes the records
epikv's own engine writes, float32: the same token ids, texts, verdicts and cache counters, with the
same prompts checked the same way. The model is epikv's tiny Llama with the embedded model's tokenizer
and chat template (``conftest.tiny["served"]``): the records are the engines' to agree on, whatever
the weights (the embedded model's tokens under the plugin are ``test_engine.py``'s)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="runs in .venv-vllm (setup.sh --vllm)")


def _eval(out: Path, engine: str, model: str, *extra: str) -> list[dict]:
    from epikv.eval.cli import build_parser

    args = build_parser().parse_args([
        "eval", "--dataset", "gsm8k:shuffle=0", "--policy", "epikv", "--budget", "160", "--limit", "4",
        "--batch-size", "4", "--max-new-tokens", "200", "--dtype", "float32", "--engine", engine,
        "--no-progress", "--model", model, "--out", str(out), *extra,
    ])  # fmt: skip
    assert args.func(args) == 0
    (folder,) = {p.parent for p in out.rglob("results.jsonl")}
    config = json.loads((folder / "config.json").read_text())
    assert config["engine"] == engine
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_vllm_writes_the_records_epikvs_engine_writes(tiny, tmp_path):
    ours = _eval(tmp_path / "epikv", "epikv", tiny["served"])
    theirs = _eval(tmp_path / "vllm", "vllm", tiny["served"])
    same = ("id", "token_ids", "text", "correct", "extracted", "finish_reason", "evictions", "prompt_tokens")
    assert [{k: r[k] for k in same} for r in theirs] == [{k: r[k] for k in same} for r in ours]
    assert sum(r["evictions"] for r in ours) > 0  # the budget bites: compactions ran on both engines
    assert [r["peak_cache_tokens"] for r in theirs] == [r["peak_cache_tokens"] for r in ours]
    assert all(r["final_cache_tokens"] is None for r in theirs)  # vLLM does not report it: not made up
