"""The model a benchmark runs: a named random-weight model or a real one, and its tokenizer.

Owns the random-weight presets (``random:<preset>``) that benchmarks and tests load without a
network, their byte tokenizer, and loading any other name through :func:`epikv.models.load_model`;
plus the two things a benchmark does to a loaded model before it measures (name it, page it in).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from epikv.models.tiny import config_from_spec, random_weights, tiny_spec

# Random-weight models of known shapes: tests and machines without weights still run every kind.
# The tests' tiny shape, with room for the speed benchmark's long decodes (8192 positions, not 4096).
RANDOM_PRESETS: dict[str, dict[str, Any]] = {
    f"tiny-{arch}": tiny_spec(arch, max_position_embeddings=8192) for arch in ("llama", "qwen2")
}


class ByteTokenizer:
    """Bytes folded into a small vocabulary, for random-weight models (no chat template, no files)."""

    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.pad_token_id, self.eos_token_id = 0, 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [2 + b % (self.vocab_size - 2) for b in text.encode("utf-8")]}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i % 95) for i in ids if not (skip_special_tokens and i < 2))


def random_model(
    preset: str | dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.nn.Module:
    """A random-weight causal LM built from a preset name or a config dict (``model_type`` key)."""
    if isinstance(preset, str):
        if preset not in RANDOM_PRESETS:
            raise ValueError(f"unknown random model {preset!r} (known: {', '.join(sorted(RANDOM_PRESETS))})")
        spec, name = dict(RANDOM_PRESETS[preset]), preset
    else:
        spec, name = dict(preset), str(preset.get("name", "config"))
    spec.pop("name", None)
    config = config_from_spec(spec)
    return random_weights(config, seed, identity=f"random:{name}", dtype=dtype, device=device)


def load_bench_model(
    name: str | None, device: str = "cpu", dtype: str = "float32"
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for a benchmark: ``random:<preset>`` builds a random model, anything else
    goes through :func:`epikv.models.load_model` (None = the embedded model)."""
    torch_dtype = getattr(torch, dtype)
    if name is not None and name.startswith("random:"):
        model = random_model(name.split(":", 1)[1], dtype=torch_dtype, device=device)
        return model, ByteTokenizer(model.config.vocab_size)
    from epikv.models import load_model

    return load_model(name, dtype=torch_dtype, device=device if device != "cpu" else None)


def load_bench_tokenizer(name: str | None) -> Any:
    """The tokenizer :func:`load_bench_model` returns for ``name``, without the weights: what reads a
    benchmark's stored token ids back (a re-grade)."""
    if name is not None and name.startswith("random:"):
        preset = name.split(":", 1)[1]
        if preset not in RANDOM_PRESETS:
            raise ValueError(f"unknown random model {preset!r} (known: {', '.join(sorted(RANDOM_PRESETS))})")
        spec = {k: v for k, v in RANDOM_PRESETS[preset].items() if k != "name"}
        return ByteTokenizer(config_from_spec(spec).vocab_size)
    from epikv.models import load_tokenizer

    return load_tokenizer(name)


def model_name(model: torch.nn.Module) -> str:
    from epikv.models import model_identity

    return model_identity(model)


def page_in(model: torch.nn.Module) -> None:
    """Run an 8-token forward so lazily mapped weights are resident before a memory baseline."""
    ids = torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
