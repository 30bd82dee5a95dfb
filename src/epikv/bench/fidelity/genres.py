"""The text genres of the fidelity study: which bundled records, and how they become token ids.

Two kinds of genre:

* forced: the package ships the continuation. A passage (``prose``, ``code``: the ``text`` field;
  ``math500-solutions``: problem and reference solution) is tokenised whole as raw text, without a
  chat template; its first ``prompt_tokens`` tokens are the prompt and the next ``trace_tokens`` the
  continuation that is teacher-forced. Passages too short for that split are skipped.
* generated (``gsm8k-greedy``, ``math500-greedy``): only the prompt is shipped, the problem in the
  paper's chat protocol (system message, problem as the user turn); the continuation is the model's
  own greedy trace, so it is left to the caller to generate.

This module owns the genre table and the split. It does not load models, generate or force tokens.
Where the prose and code come from and under which licences: ``epikv/data/README.md``.
"""

from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Genre:
    """A bundled data file and the record fields whose text (joined by a blank line) is used."""

    name: str
    data: str
    fields: tuple[str, ...]
    forced: bool
    description: str


GENRES: dict[str, Genre] = {
    genre.name: genre
    for genre in (
        Genre("math500-solutions", "math500", ("problem", "solution"), True, "MATH-500 reference solutions"),
        Genre("prose", "prose", ("text",), True, "SQLite documentation prose (public domain)"),
        Genre("code", "code", ("text",), True, "Python modules of networkx, sympy and pydantic"),
        Genre("gsm8k-greedy", "gsm8k", ("problem",), False, "the model's greedy traces on GSM8K"),
        Genre("math500-greedy", "math500", ("problem",), False, "the model's greedy traces on MATH-500"),
    )
}


@dataclass(frozen=True)
class GenreItem:
    """One prompt of a genre. ``continuation_ids`` is None when the model must generate the
    ``trace_tokens`` tokens itself (greedy genres); else it holds exactly ``trace_tokens`` ids."""

    id: str
    prompt_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...] | None
    trace_tokens: int

    @property
    def forced(self) -> bool:
        return self.continuation_ids is not None


def get_genre(name: str) -> Genre:
    if name not in GENRES:
        close = difflib.get_close_matches(name, list(GENRES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown genre {name!r} (known: {', '.join(GENRES)}){hint}")
    return GENRES[name]


@functools.cache
def _records(data: str) -> tuple[dict[str, Any], ...]:
    text = resources.files("epikv").joinpath("data", f"{data}.jsonl").read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def genre_texts(name: str) -> list[tuple[str, str]]:
    """``(id, text)`` of every record of a genre in file order: the whole passage for a forced genre,
    the problem statement for a generated one."""
    genre = get_genre(name)
    return [(r["id"], "\n\n".join(r[f] for f in genre.fields)) for r in _records(genre.data)]


def load_genre(
    name: str,
    tokenizer: Any,
    *,
    prompt_tokens: int = 96,
    trace_tokens: int = 600,
    count: int | None = None,
    offset: int = 0,
    chat: bool = True,
) -> list[GenreItem]:
    """The prompts of a genre as token ids, in file order.

    Args:
        name: a key of :data:`GENRES`.
        tokenizer: a Hugging Face style tokenizer (``tokenizer(text)["input_ids"]``; the chat
            template, when it has one, is used for generated genres only).
        prompt_tokens: prompt length of a forced item (generated genres use the whole chat prompt).
        trace_tokens: continuation length: forced tokens, or tokens the caller must generate.
        count: how many items (None = all eligible); more than there are is an error.
        offset: eligible items to skip first (a held-out split starts where another ends).
        chat: wrap generated genres' problems in the chat template when the tokenizer has one.

    Returns:
        ``count`` items. Forced: ``prompt_ids`` = passage ids [0, P), ``continuation_ids`` = [P, P+T).
        Generated: the chat prompt's ids and ``continuation_ids=None``.
    """
    genre = get_genre(name)
    if prompt_tokens < 1 or trace_tokens < 1 or offset < 0 or (count is not None and count < 1):
        raise ValueError(
            f"need prompt_tokens >= 1, trace_tokens >= 1, offset >= 0 and count >= 1 or None; got "
            f"{prompt_tokens}, {trace_tokens}, {offset}, {count}"
        )
    wanted = None if count is None else offset + count
    items = []
    for item_id, text in genre_texts(name):
        if wanted is not None and len(items) == wanted:
            break
        if genre.forced:
            item = _split(item_id, tokenizer(text)["input_ids"], prompt_tokens, trace_tokens)
        else:
            item = GenreItem(item_id, _chat_prompt(tokenizer, text, chat), None, trace_tokens)
        if item is not None:
            items.append(item)
    chosen = items[offset:]
    if not chosen or (count is not None and len(chosen) < count):
        need = f" of at least {prompt_tokens + trace_tokens} tokens" if genre.forced else ""
        raise ValueError(
            f"genre {name!r} has {len(items)} items{need}; asked for {count or 'some'} after offset {offset}"
        )
    return chosen


def _split(item_id: str, ids: list[int], prompt_tokens: int, trace_tokens: int) -> GenreItem | None:
    if len(ids) < prompt_tokens + trace_tokens:
        return None
    prompt, continuation = ids[:prompt_tokens], ids[prompt_tokens : prompt_tokens + trace_tokens]
    return GenreItem(item_id, tuple(prompt), tuple(continuation), trace_tokens)


def _chat_prompt(tokenizer: Any, problem: str, chat: bool) -> tuple[int, ...]:
    from epikv.eval.prompts import build_messages
    from epikv.generation import encode_prompts

    use_template = chat and getattr(tokenizer, "chat_template", None)
    ids, _ = encode_prompts(tokenizer, [build_messages(problem) if use_template else problem], chat)
    return tuple(int(i) for i in ids[0])
