"""What a task is: a sliceable, gradeable view of a list of examples.

Owns `Example`, `Grade` and `Task` (length, item access, slicing and `evaluate(example, completion)`;
a task never generates). Where tasks come from (the shipped JSONL files, any JSONL file, a dataset
hub) is `tasks.py`'s and `hub.py`'s business; both build on this module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
