"""The plugin's limits without an engine: each reservation clamped as vLLM clamps its own, the need of
one request that vLLM's start-up check and auto-fit see, the field a refusal names, and the error a
request the plugin failed answers with (issue 57 items 1 to 3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from vllm.exceptions import GenerationError, VLLMValidationError
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import estimate_max_model_len

from epikv.policies.base import ModelInfo
from epikv.vllm import plugin
from epikv.vllm.config import BUDGET_ARG, EpiKVSettings, plan_request
from epikv.vllm.scheduler import EpiKVAttentionSpec

B = 32
MODEL = ModelInfo("m", 30, 9, 3, 64, 576)


def test_a_reservation_never_passes_max_model_len_nor_the_block_table_row():
    """The offline call of issue 57: Seg-Q at K = 1,024 in a 1,024-token context, a 327-token prompt,
    max_tokens 1,024. vLLM stops it at 1,024 tokens (697 new); its cap, 1,024 + tau = 1,152, would
    take 36 blocks of a 32-block row."""
    spec = EpiKVSettings("epikv", 1024).spec(MODEL)
    assert spec.cap_tokens(327) == 1024 + 128
    plan = plan_request(spec, 327, 1024, None, max_model_len=1024)
    assert plan.reserve == 1024 and cdiv(plan.reserve, B) == cdiv(1024, B)
    assert plan_request(spec, 327, None, None, max_model_len=1024).reserve == 1024  # vLLM's default
    assert plan_request(spec, 327, 1024, None).reserve == 1024 + 128  # no context: epikv's own engine


@pytest.mark.parametrize("policy", ["epikv", "streaming", "keydiff"])
def test_the_reservation_is_the_specs_peak_of_what_vllm_lets_a_request_generate(policy):
    spec = EpiKVSettings(policy, 64).spec(MODEL)
    for context in (256, 1024):
        for prompt in (1, 40, 63, 64, 200, context - 1):
            for max_tokens in (1, 30, 500, 5000):
                for budget in (None, 32):
                    extra = {BUDGET_ARG: budget} if budget else None
                    plan = plan_request(spec, prompt, max_tokens, extra, context)
                    new = min(max_tokens, context - prompt)
                    assert plan.reserve == spec.peak_tokens(prompt, new, plan.budget) <= context


def vllm_config(policy: str, budget: int, max_model_len: int) -> SimpleNamespace:
    hf = LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64
    )
    model = SimpleNamespace(max_model_len=max_model_len, model="m", hf_config=hf, hf_text_config=hf)
    return SimpleNamespace(
        additional_config={"epikv": {"policy": policy, "budget": budget}}, model_config=model
    )


@pytest.mark.parametrize("policy", ["epikv", "streaming"])
def test_start_up_sees_one_request_of_max_model_len_as_vllm_does(policy):
    """vLLM's own search (its start-up check's estimate and its auto-fit) on the capped spec: a pool
    of 68 blocks (2,176 tokens) serves a context of 2,176 tokens (a prompt is held whole until its
    first compaction), not the 4,096 asked for, however small K + tau is."""
    config = vllm_config(policy, 128, 4096)
    spec = EpiKVAttentionSpec(block_size=B, num_kv_heads=3, head_size=64, dtype=torch.float32, cap_tokens=144)
    pool = 68 * spec.page_size_bytes
    fits = estimate_max_model_len(config, {"layer": spec}, pool)
    assert fits in (2176, 2177) and config.model_config.max_model_len == 4096
    assert spec.max_memory_usage_bytes(config) == cdiv(longest_request_of(config), B) * spec.page_size_bytes


def longest_request_of(config: SimpleNamespace) -> int:
    from epikv.vllm.config import longest_request

    spec = EpiKVSettings.from_config(config.additional_config).spec(MODEL)
    tokens = longest_request(spec, config.model_config.max_model_len)
    assert tokens in (4095, 4096)
    return tokens


def test_a_prompt_the_pool_cannot_hold_is_blamed_on_the_prompt_not_max_tokens():
    spec = EpiKVSettings("epikv", 128, 16).spec(MODEL)
    usable = 60  # blocks: 1,920 tokens

    def refused(prompt: int, max_tokens: int) -> VLLMValidationError:
        params = SimpleNamespace(max_tokens=max_tokens, extra_args=None)
        with pytest.raises(VLLMValidationError) as err:
            plugin._admit(spec, prompt, params, usable, B, 4096)
        return err.value

    # 2,000 tokens and one more pass 60 blocks whatever max_tokens is
    assert (refused(2000, 8).parameter, refused(2000, 8).value) == ("prompt", 2000)
    token = plugin.PROMPT_FIELD.set("messages")  # a chat names its messages
    try:
        assert refused(2000, 8).parameter == "messages"
    finally:
        plugin.PROMPT_FIELD.reset(token)
    # 1,800 fit with a few new tokens (1,944 at most: K + 128 + tau); 200 of them do not
    err = refused(1800, 200)
    assert (err.parameter, err.value) == ("max_tokens", 200) and "reserves 1944 tokens" in str(err)
    plugin._admit(spec, 1800, SimpleNamespace(max_tokens=100, extra_args=None), usable, B, 4096)


def output(stats: dict | None, reason: str = "error", n: int = 1) -> SimpleNamespace:
    params = None if stats is None else {"epikv": stats}
    choices = [SimpleNamespace(finish_reason=reason) for _ in range(n)]
    return SimpleNamespace(finished=True, outputs=choices, kv_transfer_params=params)


def test_a_failed_request_answers_400_when_refused_and_500_with_its_line_otherwise():
    from epikv.vllm import answers

    refused = answers.failure(output({"error": "epikv: request x: no", "refused": "budget"}), "messages")
    assert isinstance(refused, VLLMValidationError) and refused.parameter == BUDGET_ARG
    rho = answers.failure(output({"error": "epikv: request x: no", "refused": "rank_every"}), "messages")
    assert isinstance(rho, VLLMValidationError) and rho.parameter == "epikv_rank_every"
    prompt = answers.failure(output({"error": "epikv: too long", "refused": "prompt"}), "messages")
    assert isinstance(prompt, VLLMValidationError) and prompt.parameter == "messages"
    fault = answers.failure(output({"error": "epikv: request x: compaction failed: E: f"}), "prompt")
    assert type(fault) is GenerationError and str(fault) == "epikv: request x: compaction failed: E: f"
    # n > 1: the parent carries one child's counters, and every child's in choice order
    child = {"error": "epikv: request y: prefill failed: E: g"}
    parent = output({"peak_cache_tokens": 3}, n=2)
    parent.kv_transfer_params["epikv_choices"] = [{"peak_cache_tokens": 3}, child]
    assert str(answers.failure(parent, "prompt")) == child["error"]
    assert answers.failure(output(None), "prompt") is None  # vLLM's own error: its own 500
    assert answers.failure(output({"error": "x"}, reason="length"), "prompt") is None
