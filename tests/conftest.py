"""Tiny random-weight models (no network) shared by the tests."""

from __future__ import annotations

import pytest
import torch

from epikv.integration.arch import ARCHITECTURES
from epikv.models.tiny import tiny_model as build_tiny_model

# Tiny models run faster on one thread than with two threads waking per op.
torch.set_num_threads(1)

# tests/vllm runs in vLLM's own environment (.venv-vllm, README's test command), not in this one.
collect_ignore = ["vllm"]


@pytest.fixture(autouse=True)
def _one_thread_again():
    """Commands under test choose their threads (``--threads auto``); the next test gets one again."""
    yield
    torch.set_num_threads(1)


def make_tiny(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """The library's tiny model (4 layers, sdpa, 4096 positions) named ``tiny-<arch>``."""
    return build_tiny_model(arch, seed, identity=f"tiny-{arch}")


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


SERVE_MODEL_NAME = "tiny-serve"


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


# Bands for the 4-layer tiny models (Band A = 1, Band B = 2): every banded policy needs them.
TINY_BANDS = {"band_a": 1, "band_b": 2}


def policy_params(name: str) -> dict:
    from epikv.policies import policy_class
    from epikv.policies.epiphany import BandedPolicy

    return dict(TINY_BANDS) if issubclass(policy_class(name), BandedPolicy) else {}


class CharTokenizer:
    """A tiny character tokenizer (no chat template) so generation tests need no files."""

    pad_token_id = 0
    eos_token_id = 1
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [2 + (ord(c) % 90) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i % 90)) for i in ids if not (skip_special_tokens and i < 2))


@pytest.fixture(scope="session")
def tok() -> CharTokenizer:
    return CharTokenizer()
