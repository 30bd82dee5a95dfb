"""The fixtures every test folder shares: tiny random-weight models (no network), the embedded
tokenizer, the toy tokenizer. Helpers to import are in :mod:`tests.helpers`."""

from __future__ import annotations

import pytest
import torch

from epikv.archs import ARCHITECTURES
from epikv.models.tiny import tiny_model as build_tiny_model
from tests.helpers.models import SERVE_MODEL_NAME, make_tiny
from tests.helpers.tokenizer import CharTokenizer

# Tiny models run faster on one thread than with two threads waking per op.
torch.set_num_threads(1)

# tests/vllm runs in vLLM's own environment (.venv-vllm, README's test command), not in this one.
collect_ignore = ["vllm"]


@pytest.fixture(autouse=True)
def _one_thread_again():
    """Commands under test choose their threads (``--threads auto``); the next test gets one again."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request) -> torch.nn.Module:
    return make_tiny(request.param)


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def arch_model(request) -> torch.nn.Module:
    """The tiny model of every supported architecture: the tests that take it are the proof that
    `epikv policies --models` reports for each (a new table entry is enrolled automatically)."""
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    return make_tiny("llama")


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from epikv.models import load_model

    return load_model()[1]


@pytest.fixture(scope="session")
def serve_model(embedded_tokenizer) -> torch.nn.Module:
    """Random weights over the embedded tokenizer's vocabulary, so text round-trips as with a real model."""
    return build_tiny_model("llama", 3, identity=SERVE_MODEL_NAME, vocab_size=len(embedded_tokenizer))


@pytest.fixture(scope="session")
def serve_model_folder(tmp_path_factory, serve_model, embedded_tokenizer):
    """That model and tokenizer saved as a local model folder (what `--model PATH` loads)."""
    folder = tmp_path_factory.mktemp("models") / SERVE_MODEL_NAME
    serve_model.save_pretrained(folder)
    embedded_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tok() -> CharTokenizer:
    return CharTokenizer()
