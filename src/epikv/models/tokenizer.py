"""Tokenizer checks and repairs: whether a tokenizer can be trusted, and making it ready to generate.

Owns the round-trip check of the embedded (SmolLM2) tokenizer, the fingerprint stored next to its
cached copy, the repair of a cached copy that does not round-trip, and the padding/eos setup every
loaded tokenizer gets. It does not know where tokenizers come from: the caller passes the candidates
(the GGUF reader among them) in the order to try.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_ROUNDTRIP_TEXT = "Hello world!\n  x = 1 + 2"
_CHAT_MESSAGES = [{"role": "user", "content": "What is 17 * 3?\nAnswer  briefly, then explain."}]
_CHAT_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")

TokenizerSource = tuple[str, Callable[[], "PreTrainedTokenizerBase"]]
"""A label for error messages and a function that loads one candidate tokenizer."""


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> None:
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


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
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


def generic_fast_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The saved ``tokenizer.json`` loaded with the generic fast class, whatever the config names."""
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


def load_checked_tokenizer(
    folder: Path, sources: Sequence[TokenizerSource], expected: dict[str, Any] | None
) -> PreTrainedTokenizerBase:
    """The first of ``sources`` that passes :func:`tokenizer_problem`; when it is not the first, its
    files replace the broken ones saved in ``folder`` (so the next load is fast again).

    Raises:
        RuntimeError: no source gives a tokenizer that round-trips; the message lists what each did.
    """
    problems: list[str] = []
    for index, (label, make) in enumerate(sources):
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
                        f"epikv: could not rewrite the tokenizer in {folder}: {error}", stacklevel=5
                    )
            return tokenizer
        problems.append(f"{label} ({type(tokenizer).__name__}): {problem}")
    raise RuntimeError(
        "The embedded model's tokenizer does not encode and decode text exactly, so the model would answer "
        f"nonsense. Tried: {'; '.join(problems)}. Delete {folder} and retry; if that fails too, the "
        "installed transformers/tokenizers versions cannot read this tokenizer."
    )
