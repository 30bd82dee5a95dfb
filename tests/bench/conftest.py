"""Shared pieces of the benchmark tests: a tiny model with its byte tokenizer and a short prompt file."""

from __future__ import annotations

from pathlib import Path

import pytest

from epikv.bench.shared import model_loading


@pytest.fixture(scope="session")
def tiny_pair():
    model = model_loading.random_model("tiny-llama")
    return model, model_loading.ByteTokenizer(model.config.vocab_size)


@pytest.fixture(scope="session")
def short_prompts(tmp_path_factory) -> Path:
    """Two short paragraphs: with the byte tokenizer each is a ~40-token prompt."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text(
        "Ann has 3 apples and buys 2 more. How many?\n\nA train runs at 60 km/h for 2 h. How far?\n"
    )
    return path
