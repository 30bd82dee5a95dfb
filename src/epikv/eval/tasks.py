"""Evaluation tasks: a dataset view plus pure grading.

A `Task` has a length, item access, slicing and `evaluate(example, completion)`; it never generates.
Tasks come from the JSONL files shipped in `epikv/data/` (math500, aime2024, amc2023, gsm8k), from
any JSONL file with `problem`/`answer` fields, or from a dataset hub (`hf:...`, see `hub.py`).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from epikv.eval.extract import extract_boxed, extract_final_number
from epikv.eval.grading import GRADERS

# Length caps of the paper's protocol (§1.9): 8192 new tokens for MATH-500, 16384 for AIME.
DEFAULT_MAX_NEW_TOKENS = 8192


@dataclass(frozen=True)
class Example:
    """One problem. `index` is its position in the full dataset, before any slicing."""

    id: str
    problem: str
    answer: str
    index: int


@dataclass(frozen=True)
class Grade:
    correct: bool
    extracted: str | None


@dataclass(frozen=True)
class BuiltinTask:
    file: str
    grader: str
    max_new_tokens: int


BUILTIN_TASKS: dict[str, BuiltinTask] = {
    "math500": BuiltinTask("math500.jsonl", "math", 8192),
    "aime2024": BuiltinTask("aime2024.jsonl", "math", 16384),
    "amc2023": BuiltinTask("amc2023.jsonl", "math", 8192),
    "gsm8k": BuiltinTask("gsm8k.jsonl", "numeric", 8192),
}


class Task:
    """A sliceable, gradeable view of a list of examples."""

    def __init__(
        self,
        name: str,
        examples: Sequence[Example],
        grader: str = "math",
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ) -> None:
        if grader not in GRADERS:
            raise ValueError(f"unknown grader {grader!r}; known: {sorted(GRADERS)}")
        ids = [example.id for example in examples]
        if len(set(ids)) != len(ids):
            duplicate = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"task {name!r} has duplicate example id {duplicate!r}")
        self.name = name
        self.grader = grader
        self.max_new_tokens = max_new_tokens
        self._examples = tuple(examples)

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, position: int) -> Example:
        return self._examples[position]

    def __iter__(self) -> Iterator[Example]:
        return iter(self._examples)

    def slice(self, offset: int = 0, limit: int | None = None) -> Task:
        """The examples `offset .. offset + limit` of this view (all remaining ones when limit is None)."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit}")
        stop = None if limit is None else offset + limit
        return Task(self.name, self._examples[offset:stop], self.grader, self.max_new_tokens)

    def evaluate(self, example: Example, completion: str) -> Grade:
        """Extracts the final answer from `completion` (boxed; for the numeric grader, GSM8K's
        flexible fallback) and grades it against `example.answer`."""
        extracted = (
            extract_final_number(completion) if self.grader == "numeric" else extract_boxed(completion)
        )
        return Grade(correct=GRADERS[self.grader](extracted, example.answer), extracted=extracted)


def examples_from_rows(rows: Sequence[dict[str, object]], source: str) -> list[Example]:
    """Examples from JSON objects with `problem` and `answer` (and optionally `id`) fields."""
    examples = []
    for index, row in enumerate(rows):
        missing = [key for key in ("problem", "answer") if key not in row]
        if missing:
            raise ValueError(f"{source}: row {index} lacks field(s) {missing}")
        example_id = str(row.get("id", index))
        examples.append(Example(example_id, str(row["problem"]), str(row["answer"]), index))
    return examples


def read_jsonl_rows(text: str, source: str) -> list[dict[str, object]]:
    rows = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}:{line_number}: not valid JSON ({err.msg})") from err
    return rows


def load_builtin(name: str) -> Task:
    spec = BUILTIN_TASKS[name]
    text = resources.files("epikv").joinpath("data", spec.file).read_text(encoding="utf-8")
    examples = examples_from_rows(read_jsonl_rows(text, spec.file), spec.file)
    return Task(name, examples, spec.grader, spec.max_new_tokens)


def load_jsonl(path: Path, grader: str = "math") -> Task:
    rows = read_jsonl_rows(path.read_text(encoding="utf-8"), str(path))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem)
    return Task(name, examples_from_rows(rows, str(path)), grader)


def load_task(spec: str) -> Task:
    """A task by builtin name, JSONL path, or `hf:DATASET[:CONFIG][:SPLIT]` (needs `datasets` and network)."""
    if spec in BUILTIN_TASKS:
        return load_builtin(spec)
    if spec.startswith("hf:"):
        from epikv.eval.hub import load_hub_task

        return load_hub_task(spec)
    path = Path(spec)
    if path.suffix == ".jsonl" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"dataset file not found: {spec}")
        return load_jsonl(path)
    close = difflib.get_close_matches(spec, BUILTIN_TASKS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown dataset {spec!r}{hint}; use one of {sorted(BUILTIN_TASKS)}, a .jsonl path or hf:NAME"
    )
