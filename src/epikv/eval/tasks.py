"""Where evaluation tasks come from: the builtin datasets, JSONL files and the dataset hub.

Tasks come from the JSONL files shipped in `epikv/data/` (math500, aime2024, amc2023, gsm8k), from
any JSONL file with `problem`/`answer` fields, or from a dataset hub (`hf:...`, see `hub.py`). What a
task is (`Example`, `Grade`, `Task`) lives in `task.py` and is re-exported here.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from epikv.eval.hub import load_hub_task
from epikv.eval.task import DEFAULT_MAX_NEW_TOKENS, Example, Grade, Task

__all__ = [
    "BUILTIN_TASKS",
    "DEFAULT_MAX_NEW_TOKENS",
    "BuiltinTask",
    "Example",
    "Grade",
    "Task",
    "examples_from_rows",
    "load_builtin",
    "load_jsonl",
    "load_task",
    "read_jsonl_rows",
]


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


def load_task(spec: str) -> Task:
    """A task by builtin name, JSONL path, or `hf:DATASET[:CONFIG][:SPLIT]` (needs `datasets` and network)."""
    if spec in BUILTIN_TASKS:
        return load_builtin(spec)
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
