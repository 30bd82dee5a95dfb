"""Tasks from a public dataset hub, for users who are online.

Owns the `hf:DATASET[:CONFIG][:SPLIT]` spec and the mapping of hub rows onto `Example`s. It needs the
optional `datasets` package and network access; neither is available in our CI, so `load_hub_task`
itself is not exercised by the tests (the spec parsing and row mapping are).

Known hub copies of the builtin tasks: `hf:HuggingFaceH4/MATH-500` (split test),
`hf:HuggingFaceH4/aime_2024:train`, `hf:openai/gsm8k:main:test`. Prefer the builtin names: the
shipped files are pinned and verified, a hub dataset can change under the same name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from epikv.eval.task import Example, Task

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
