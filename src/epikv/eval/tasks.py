"""Evaluation tasks: what a task is, and where tasks come from.

Owns `Example`, `Grade` and `Task` (length, item access, slicing and `evaluate(example, completion)`;
a task never generates), and the sources of tasks: the JSONL files shipped in `epikv/data/`
(math500, aime2024, amc2023, gsm8k), any JSONL file with `problem`/`answer` fields, and a public
dataset hub (`hf:DATASET[:CONFIG][:SPLIT]`, for users who are online).

The hub needs the optional `datasets` package and network access; neither is available in our CI, so
`load_hub_task` itself is not exercised by the tests (the spec parsing and row mapping are). Known hub
copies of the builtin tasks: `hf:HuggingFaceH4/MATH-500` (split test), `hf:HuggingFaceH4/aime_2024:train`,
`hf:openai/gsm8k:main:test`. Prefer the builtin names: the shipped files are pinned and verified, a hub
dataset can change under the same name.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from epikv.eval.extract import extract_boxed, extract_final_number
from epikv.eval.forms import asked_forms, in_forms
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

    def evaluate(self, example: Example, completion: str, cut: bool = False) -> Grade:
        """Extracts the final answer from `completion` (boxed; for the numeric grader, GSM8K's
        flexible fallback, which ``cut``, a generation stopped at the length cap, narrows) and
        grades it against `example.answer`, in the form the problem asks for where it asks
        (``forms.py``)."""
        extracted = (
            extract_final_number(completion, cut) if self.grader == "numeric" else extract_boxed(completion)
        )
        in_form = in_forms(extracted, asked_forms(example.problem))
        return Grade(correct=in_form and GRADERS[self.grader](extracted, example.answer), extracted=extracted)


# -- where tasks come from: the builtin files and any JSONL file ----------------------------------


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


def shuffled(task: Task, seed: int) -> Task:
    """``task`` in a fixed order drawn from ``seed``: sorted by sha256 of ``"<seed>:<id>"``, the same on
    every machine and version. Any prefix (``--limit N``) is then a seeded random sample of N
    problems, and a larger N keeps the smaller one's problems; the last problems are disjoint from
    every prefix that stops before them (a hold-out, e.g. for calibration). Examples keep their
    ``index`` in the full dataset."""
    order = sorted(task, key=lambda e: hashlib.sha256(f"{seed}:{e.id}".encode()).hexdigest())
    return Task(f"{task.name}-shuffle{seed}", order, task.grader, task.max_new_tokens)


def load_task(spec: str) -> Task:
    """A task by builtin name (``NAME:shuffle=SEED`` for :func:`shuffled`), JSONL path, or
    `hf:DATASET[:CONFIG][:SPLIT]` (needs `datasets` and network)."""
    if spec in BUILTIN_TASKS:
        return load_builtin(spec)
    name, _, option = spec.partition(":")
    if name in BUILTIN_TASKS:
        match = re.fullmatch(r"shuffle=(\d+)", option)
        if match is None:
            raise ValueError(f"dataset {spec!r}: after {name}: only shuffle=SEED (a whole number) is known")
        return shuffled(load_builtin(name), int(match.group(1)))
    if spec.startswith("hf:"):
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


# -- the dataset hub -------------------------------------------------------------------------------

_PROBLEM_FIELDS = ("problem", "question", "Problem", "Question")
_ANSWER_FIELDS = ("answer", "Answer", "final_answer")
_ID_FIELDS = ("id", "unique_id", "ID")


@dataclass(frozen=True)
class HubSpec:
    dataset: str
    config: str | None
    split: str

    @property
    def task_name(self) -> str:
        return "hf-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", self.dataset)


def parse_hub_spec(spec: str) -> HubSpec:
    """`hf:NAME` (split test), `hf:NAME:SPLIT` or `hf:NAME:CONFIG:SPLIT`."""
    if not spec.startswith("hf:"):
        raise ValueError(f"hub dataset spec must start with 'hf:', got {spec!r}")
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise ValueError(f"bad hub dataset spec {spec!r}; expected hf:NAME[:CONFIG][:SPLIT]")
    if len(parts) == 1:
        return HubSpec(parts[0], None, "test")
    if len(parts) == 2:
        return HubSpec(parts[0], None, parts[1])
    return HubSpec(parts[0], parts[1], parts[2])


def _first_field(row: Mapping[str, object], names: tuple[str, ...], index: int) -> object:
    for name in names:
        if name in row:
            return row[name]
    raise ValueError(f"hub row {index} has none of the fields {list(names)}; fields: {sorted(row)}")


def hub_answer(raw: object) -> str:
    """The final answer of a hub row: GSM8K-style `rationale #### 1,234` becomes `1234`."""
    text = str(raw)
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text.strip()


def examples_from_hub_rows(rows: Iterable[Mapping[str, object]], name: str) -> list[Example]:
    examples = []
    for index, row in enumerate(rows):
        problem = str(_first_field(row, _PROBLEM_FIELDS, index))
        answer = hub_answer(_first_field(row, _ANSWER_FIELDS, index))
        found_id = next((row[key] for key in _ID_FIELDS if key in row), None)
        example_id = str(found_id) if found_id is not None else f"{name}-{index:04d}"
        examples.append(Example(example_id, problem, answer, index))
    return examples


def load_hub_task(spec: str) -> Task:
    """Downloads `spec` with `datasets.load_dataset`. Untested offline: needs `datasets` and network."""
    parsed = parse_hub_spec(spec)
    try:
        import datasets
    except ModuleNotFoundError as err:
        raise ImportError(
            f"dataset {spec!r} needs the 'datasets' package (pip install datasets) and network access; "
            "the builtin names math500, aime2024, amc2023 and gsm8k work offline"
        ) from err
    rows = datasets.load_dataset(parsed.dataset, parsed.config, split=parsed.split)
    grader = "numeric" if "gsm8k" in parsed.dataset.lower() else "math"
    max_new_tokens = 16384 if "aime" in parsed.dataset.lower() else 8192
    examples = examples_from_hub_rows(rows, parsed.task_name)
    return Task(parsed.task_name, examples, grader, max_new_tokens)
