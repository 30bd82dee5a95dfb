"""epikv's engine on the real Qwen2.5-Coder-1.5B-Instruct weights (issue 41): the model the accuracy
study runs on.

Slow (``pytest -m slow``) and it needs the weights: ``bash scripts/setup.sh --qwen`` installs them
(docs/qwen-real-weights.md). Without them every test here fails with one line naming that command.
"""

from __future__ import annotations

import pytest
import torch

from epikv.engine import Engine, Request
from epikv.generation import encode_prompt_ids
from epikv.integration import build_spec

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 * 23? Think step by step.",
]


@pytest.fixture(scope="module")
def qwen():
    from epikv.models import load_model

    try:
        return load_model("qwen2.5-coder-1.5b", dtype=torch.float32)
    except ModuleNotFoundError as error:
        missing = str(error)  # failed outside the except: one line, no chained traceback
    pytest.fail(missing, pytrace=False)


def test_it_is_the_qwen2_instruct_model_the_study_names(qwen):
    from epikv.models import model_identity

    model, tokenizer = qwen
    assert model_identity(model) == "qwen2.5-coder-1.5b"
    config = model.config
    assert (config.model_type, config.num_hidden_layers) == ("qwen2", 28)
    assert (config.num_attention_heads, config.num_key_value_heads) == (12, 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_full_gives_transformers_own_greedy_tokens(qwen):
    model, tokenizer = qwen
    ids = encode_prompt_ids(tokenizer, QUESTIONS)
    engine = Engine(model, build_spec(model, "full", None))
    requests = [Request(row, max_new_tokens=NEW_TOKENS) for row in ids]
    done = {c.request_id: c.token_ids for c in engine.run(requests)}
    for request, row in zip(requests, ids, strict=True):
        theirs = model.generate(
            torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
        )[0, len(row):].tolist()  # fmt: skip
        assert done[request.id] == theirs


def test_the_default_policy_stays_within_its_cap_and_evicts(qwen):
    model, tokenizer = qwen
    ids = encode_prompt_ids(tokenizer, QUESTIONS[:1])
    spec = build_spec(model, "epikv", 96, interval=16)
    (done,) = Engine(model, spec).run([Request(ids[0], max_new_tokens=160)])
    assert done.evictions > 0
    assert done.peak_cache_tokens <= 96 + 16
