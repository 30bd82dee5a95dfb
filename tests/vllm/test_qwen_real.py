"""The vLLM plugin on the real Qwen2.5-Coder-1.5B-Instruct weights, float32 (issue 41): the engine
the accuracy study's cells run on. ``full`` under the plugin gives plain vLLM's tokens, and Seg-Q
(``epikv``, with the model's shipped bands) keeps epikv's own engine's sets at every compaction and
writes its tokens.

Slow (``-m slow``) and it needs the converted weights: ``bash scripts/setup.sh --qwen`` (in epikv's
environment; this one reads the converted folder). Without them every test fails with one line.
"""

from __future__ import annotations

import os

import pytest

import epikv.vllm
from tests.vllm.engines import BLOCK, close, generate, kept_sets, make_llm, reference, reference_run, tokens

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="runs in .venv-vllm (setup.sh --vllm)")
pytestmark = pytest.mark.slow

FP32_TOKEN_BYTES = 28 * 2 * 2 * 128 * 4  # layers x (K, V) x KV heads x head dim x 4 bytes
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "What is 17 * 23? Think step by step.",
]


@pytest.fixture(scope="module")
def qwen() -> dict:
    from epikv.models import QWEN25_CODER_1_5B
    from epikv.models.embedded import cache_ready
    from epikv.models.packaged import packaged_cache_folder

    folder = packaged_cache_folder(QWEN25_CODER_1_5B)
    if not cache_ready(folder):
        pytest.fail(f"{folder} is missing: run `bash scripts/setup.sh --qwen`", pytrace=False)
    prompts = reference("chat", str(folder), *QUESTIONS)["prompts"]
    return {"folder": str(folder), "prompts": prompts}


def _llm(folder: str, **kwargs):
    pool = 64 * BLOCK * FP32_TOKEN_BYTES
    return make_llm(folder, max_model_len=1024, kv_cache_memory_bytes=pool, **kwargs)


def test_full_under_the_plugin_gives_plain_vllms_tokens(qwen):
    plain = _llm(qwen["folder"])
    want = tokens(generate(plain, qwen["prompts"], 64))
    close(plain)
    full = _llm(qwen["folder"], **epikv.vllm.engine_kwargs("full", None))
    got = tokens(generate(full, qwen["prompts"], 64))
    close(full)
    assert got == want


def test_seg_q_keeps_epikvs_sets_and_tokens_on_the_real_weights(qwen, tmp_path):
    trace = tmp_path / "kept.jsonl"
    llm = _llm(qwen["folder"], **epikv.vllm.engine_kwargs("epikv", 160, trace=str(trace)))
    out = generate(llm, qwen["prompts"], 300)  # tau = 128: a compaction at 128 and 256 new tokens
    close(llm)
    ref = reference_run("epikv", 160, qwen["prompts"], 300, model=qwen["folder"])
    ours = kept_sets(trace, out)
    assert [len(sets) for sets in ours] == [2, 2]
    assert ours == ref["kept"]
    assert tokens(out) == ref["tokens"]
