"""The prompts a benchmark runs: texts from a bundled task or a file, and their token ids.

Tokenising is :func:`epikv.generation.encode_prompt_ids`'s (a batch of prompts); this module only
reads prompt texts and shapes one prompt's ids the way the benchmarks take them.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch


def load_prompts(source: str, count: int, offset: int = 0) -> list[str]:
    """Prompt texts: a bundled task (``math500``, ``gsm8k``... read from ``epikv/data``), a ``.jsonl``
    file (field ``problem``, ``prompt``, ``question`` or ``text``) or any text file (paragraphs)."""
    bundled = resources.files("epikv").joinpath("data", f"{source}.jsonl")
    path = Path(source)
    if bundled.is_file():
        lines, where = bundled.read_text(encoding="utf-8").splitlines(), f"task {source!r}"
    elif path.is_file():
        lines, where = path.read_text(encoding="utf-8").splitlines(), str(path)
    else:
        raise FileNotFoundError(f"prompt source {source!r} is neither a bundled task nor a file")
    if source.endswith(".jsonl") or bundled.is_file():
        texts = [_prompt_field(json.loads(line), where) for line in lines if line.strip()]
    else:
        texts = [p.strip() for p in "\n".join(lines).split("\n\n") if p.strip()]
    chosen = texts[offset : offset + count]
    if not chosen:
        raise ValueError(f"{where} has no prompts at offset {offset}")
    return chosen


def _prompt_field(record: dict[str, Any], where: str) -> str:
    for key in ("problem", "prompt", "question", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    raise ValueError(f"{where}: a record has none of the fields problem/prompt/question/text")


def prompt_token_ids(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of one prompt, in the chat template when ``chat`` and the tokenizer has one."""
    from epikv.generation import encode_prompt_ids

    return encode_prompt_ids(tokenizer, [text], chat)[0]


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> torch.Tensor:
    """Token ids (1, P) of one prompt (see :func:`prompt_token_ids`)."""
    return torch.tensor([prompt_token_ids(tokenizer, text, chat)], dtype=torch.long)
