"""``epikv bench goodput`` on a live vLLM (issue 56 part 3): the tiny model, eager, 4 GSM8K problems
on a pool of one ``full`` request at its longest. ``full`` (plain vLLM) admits requests by their
prompts, so it queues the fourth and preempts as the others grow; ``streaming`` at K = 32 reserves at
admission all it can ever hold and is never preempted, so more of its requests run per step."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="runs in .venv-vllm (setup.sh --vllm)")

PROMPT_BLOCKS = [4, 2, 3, 3]  # the first 4 GSM8K prompts (97, 57, 88, 66 tokens) in blocks of 32


@pytest.mark.slow
def test_a_pool_too_small_for_full_queues_and_preempts_it_and_not_an_evicting_policy(
    tiny, embedded, tmp_path
):
    from epikv.bench.goodput.study import GoodputConfig, run_goodput

    model = tmp_path / "tiny-llama"
    shutil.copytree(tiny["llama"], model)
    shutil.copy(Path(embedded["folder"]) / "chat_template.jinja", model)  # the eval's chat prompts
    pool = 288  # 9 blocks: one request of max_model_len = 97 + 160 tokens in whole blocks
    config = GoodputConfig(
        model=str(model), problems=(4,), max_new_tokens=160, policies=("full", "streaming"), budgets=(32,),
        pool_tokens=pool, eager=True, parts_dir=str(tmp_path / "parts"),
    )  # fmt: skip
    full, streaming = run_goodput(config)["results"]["rows"]
    assert full["pool_tokens"] == streaming["pool_tokens"] == pool
    # the first three prompts fill the 9 blocks (4 + 2 + 3): the fourth queues; grown, they preempt
    assert full["max_running"] == 3 and sum(PROMPT_BLOCKS) > pool // 32
    assert full["preemptions"] > 0
    assert full["max_cache_per_request"] <= 97 + 160  # prompt + generated, its longest
    assert streaming["preemptions"] == 0 and streaming["errors"] == 0
    # admitted by its reservation, max(prompt, K + tau) = its prompt here: the same first three, no more
    assert streaming["max_running"] == 3
    assert streaming["max_cache_per_request"] == 97  # a prompt is held whole until its first compaction
    # the same tokens in fewer steps: more requests ran per step
    assert streaming["generated_tokens"] == full["generated_tokens"] == 4 * 160  # no EOS: cap hits
    assert streaming["mean_running"] > full["mean_running"] and streaming["steps"] < full["steps"]
