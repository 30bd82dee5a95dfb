"""Greedy reasoning traces for calibration: generating them, finding the answer, saving them.

This module owns what a trace is (prompt ids, generated ids, where the answer starts and what the
answer is) and the rules that find the answer start and the answer key. It uses the core decode loop
with the ``full`` policy (no eviction) to generate, and the eval package's box extraction and graders.
It does not label or score anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from epikv.eval.extract import extract_boxed
from epikv.eval.grading import normalize_number

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
"""The paper's system message (method-and-baselines.md §1.9)."""

DEFAULT_MARKERS = ("####", "the answer is")
"""Final-answer phrases small instruct models write instead of a box (matched case-insensitively)."""

TAIL_TOKENS = 64
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass
class Trace:
    """One greedy trace. ``answer_start`` indexes ``ids`` (prompt + output); [P, answer_start) is
    the reasoning span that occlusion windows cover, [answer_start, end) the answer."""

    id: str
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens, without the final end-of-sequence token
    finished: bool  # the model stopped with end-of-sequence (not at the length cap)
    answer_start: int
    answer_rule: str  # think | boxed | marker | tail
    answer: str | None  # answer key of the output (see answer_key)
    gold: str | None = None
    correct: bool | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def span(self) -> tuple[int, int]:
        return self.prompt_len, self.answer_start

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def answer_key(text: str) -> str | None:
    """The final answer of a completion: the last ``\\boxed{}`` content, else the last number.

    Numbers are normalised (commas, ``$``, trailing ``.0``) so ``1,080`` and ``1080.00`` are one key;
    other box contents are compared as stripped strings. None when there is neither.
    """
    boxed = extract_boxed(text)
    if boxed is None:
        numbers = _NUMBER.findall(text)
        if not numbers:
            return None
        boxed = numbers[-1]
    return normalize_number(boxed) or " ".join(boxed.split())


def _token_at_char(decode: Callable[[list[int]], str], ids: Sequence[int], char: int) -> int:
    """Smallest k such that the decoded prefix ids[:k] is longer than ``char`` (the token holding it)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(list(ids[: mid + 1]))) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def find_answer_start(
    output_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    markers: Sequence[str] = DEFAULT_MARKERS,
    tail: int = TAIL_TOKENS,
) -> tuple[int, str]:
    """Index into ``output_ids`` where the answer starts, and which rule found it.

    Rules, first that applies (paper §1.8, plus markers for models that do not box):
    ``think``: just after the last ``</think>``; ``boxed``: the token holding the last ``\\boxed{``;
    ``marker``: the token holding the earliest marker phrase within the last ``tail`` tokens;
    ``tail``: the last ``tail`` tokens.
    """
    text = decode(list(output_ids))
    n = len(output_ids)
    close = text.rfind("</think>")
    if close >= 0:
        return _token_at_char(decode, output_ids, close + len("</think>") - 1) + 1, "think"
    box = text.rfind("\\boxed{")
    if box >= 0:
        return _token_at_char(decode, output_ids, box), "boxed"
    tail_start = max(0, n - tail)
    tail_chars = len(decode(list(output_ids[:tail_start])))
    lowered = text.lower()
    hits = [i for m in markers if m for i in _find_all(lowered, m.lower()) if i >= tail_chars]
    if hits:
        return _token_at_char(decode, output_ids, min(hits)), "marker"
    return tail_start, "tail"


def _find_all(text: str, needle: str) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(needle), text)]


def make_trace(
    trace_id: str,
    prompt_ids: list[int],
    generated: list[int],
    eos: Sequence[int],
    decode: Callable[[list[int]], str],
    markers: Sequence[str] = DEFAULT_MARKERS,
    grade: Callable[[str | None], bool] | None = None,
    gold: str | None = None,
) -> Trace:
    """A Trace from generated ids (which may end with an end-of-sequence id)."""
    finished = bool(generated) and generated[-1] in eos
    output = list(generated[:-1] if finished else generated)
    start, rule = find_answer_start(output, decode, markers)
    answer = answer_key(decode(output[start:]))
    correct = grade(answer) if grade is not None else None
    return Trace(
        trace_id, list(prompt_ids), output, finished, len(prompt_ids) + start, rule, answer, gold, correct
    )


def generate_traces(
    model: Any,
    tokenizer: Any,
    problems: Sequence[tuple[str, str, str | None]],
    max_new_tokens: int,
    batch_size: int = 8,
    markers: Sequence[str] = DEFAULT_MARKERS,
    grade: Callable[[str | None, str], bool] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[Trace]:
    """Greedy traces for ``(id, problem, gold)`` triples with the paper's chat prompt, no eviction."""
    from epikv.generation import SamplingConfig, encode_prompts, eos_ids, generate

    eos = eos_ids(model, tokenizer)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    traces: list[Trace] = []
    for lo in range(0, len(problems), batch_size):
        chunk = problems[lo : lo + batch_size]
        prompts = [chat_messages(problem) for _, problem, _ in chunk]
        results = generate(model, tokenizer, prompts, "full", None, sampling)
        for (pid, _, gold), prompt, result in zip(chunk, prompts, results, strict=True):
            prompt_ids = encode_prompts(tokenizer, [prompt])[0][0].tolist()
            grader = None if grade is None or gold is None else (lambda key, g=gold: grade(key, g))
            traces.append(make_trace(pid, prompt_ids, result.token_ids, eos, decode, markers, grader, gold))
        if on_batch is not None:
            on_batch(len(traces))
    return traces


def chat_messages(problem: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]


def save_traces(traces: Sequence[Trace], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t.to_json()) + "\n" for t in traces))


def load_traces(path: Path) -> list[Trace]:
    """Traces written by :func:`save_traces` (e.g. an earlier run's ``traces.jsonl``)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [Trace(**row) for row in rows]
