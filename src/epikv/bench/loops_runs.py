"""Model runs of the loop study: the problems as chat prompts, and one cell's greedy generations
on one batch of them.

A generation is one engine run (:class:`epikv.engine.Engine`) over a batch, in the paper's chat
protocol (:func:`epikv.eval.prompts.build_messages`), stopped at EOS or the cap, graded by the task
(:meth:`epikv.eval.task.Task.evaluate`). It keeps the token ids, so loops and divergence are found
later from the stored parts. It knows nothing of cells, levels or files (:mod:`epikv.bench.loops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epikv.engine import Engine, Request
from epikv.eval.prompts import build_messages
from epikv.eval.tasks import Example, Task, load_task
from epikv.generation import encode_prompt_ids
from epikv.spec import CacheSpec


@dataclass(frozen=True)
class Problem:
    """One problem of the study: its task (which grades it), the example and the prompt's ids."""

    dataset: str
    task: Task
    example: Example
    prompt: tuple[int, ...]

    @property
    def key(self) -> list[Any]:
        """What the problem's parts are computed from (the batch fingerprint)."""
        return [self.dataset, self.example.id, list(self.prompt)]


def load_problems(dataset: str, count: int, offset: int, tokenizer: Any, system_prompt: str) -> list[Problem]:
    """Problems ``offset .. offset + count`` of a dataset as prompts in the paper's chat protocol
    (system message, problem as the user turn); a tokenizer without a chat template (the random
    test models) gets the problem as raw text."""
    whole = load_task(dataset)
    task = whole.slice(offset, count)
    if len(task) < count:
        raise ValueError(
            f"dataset {dataset!r} has {len(whole)} problems: {count} from offset {offset} do not fit"
        )
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [build_messages(e.problem, system_prompt) if chat else e.problem for e in task]
    ids = encode_prompt_ids(tokenizer, prompts, chat)
    return [Problem(dataset, task, e, tuple(i)) for e, i in zip(task, ids, strict=True)]


def generate_cell(
    model: torch.nn.Module,
    tokenizer: Any,
    batch: list[Problem],
    spec: CacheSpec,
    max_new_tokens: int,
    stop_ids: frozenset[int],
) -> list[dict[str, Any]]:
    """Greedy generations of one batch under ``spec``, one record each: token ids, finish reason,
    grade, the engine's first evicted index and cache statistics. A prompt the budget cannot hold
    gets ``{"skipped": reason}`` (counted apart, never as wrong)."""
    engine = Engine(model, spec)
    out: list[dict[str, Any]] = [{} for _ in batch]
    runs: list[tuple[int, Request]] = []
    for i, problem in enumerate(batch):
        request = Request(list(problem.prompt), max_new_tokens, stop_ids=stop_ids)
        try:
            engine.validate(request)
        except ValueError as err:  # the budget cannot hold this prompt's protected tokens
            out[i] = {"skipped": str(err), "prompt_tokens": len(problem.prompt)}
            continue
        runs.append((i, request))
    done = engine.run([request for _, request in runs]) if runs else []
    for (i, _), completion in zip(runs, done, strict=True):
        problem = batch[i]
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        grade = problem.task.evaluate(problem.example, text)
        out[i] = {
            "prompt_tokens": completion.prompt_tokens,
            "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "correct": grade.correct,
            "extracted": grade.extracted,
            "first_evicted_index": completion.first_evicted_index,
            "evictions": completion.evictions,
            "compactions": completion.compactions,
            "peak_cache_tokens": completion.peak_cache_tokens,
            "mean_cache_tokens": completion.mean_cache_tokens,
            "seconds": round(completion.seconds, 2),
        }
    return out
