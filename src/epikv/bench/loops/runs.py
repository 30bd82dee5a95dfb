"""Model runs of the loop study: the problems as chat prompts, and one cell's greedy generations
on groups of them.

A cell's generations are one engine run (:class:`epikv.engine.Engine`) over its groups (the
study's batches), in the paper's chat protocol (:func:`epikv.eval.prompts.build_messages`), stopped
at EOS or the cap, graded by the task (:meth:`epikv.eval.task.Task.evaluate`). A request's tokens do
not depend on which others share its batch (the engine's batch-equals-alone guarantee), so packing
groups into one run changes the cost only. It keeps the token ids, so loops and divergence are found
later from the stored parts. It knows nothing of cells, levels or files (:mod:`epikv.bench.loops.study`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from epikv.engine import Completion, Engine, Request, SchedulerLimits
from epikv.eval.prompts import build_messages
from epikv.eval.tasks import Example, Grade, Task, load_task
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
    groups: list[list[Problem]],
    spec: CacheSpec,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    max_batch: int | None = None,
    on_group: Callable[[int, list[dict[str, Any]], float], None] | None = None,
) -> list[list[dict[str, Any]]]:
    """Greedy generations of every problem of ``groups`` under ``spec`` in one engine run that
    decodes up to ``max_batch`` problems together and admits the next problem as soon as one
    finishes (so a problem that runs to the cap does not leave its group's other rows idle). One
    record per problem: token ids, finish reason, grade, the engine's first evicted index and cache
    statistics; a prompt the budget cannot hold gets ``{"skipped": reason}`` (counted apart, never
    as wrong). ``on_group(g, records, seconds)`` is called as soon as group ``g`` is complete, with
    the wall seconds since the previous group completed (they add up to the run's time)."""
    engine = Engine(model, spec, SchedulerLimits(max_batch=max_batch))
    out: list[list[dict[str, Any]]] = [[{} for _ in group] for group in groups]
    where: dict[int, tuple[int, int]] = {}  # request id -> (group, index in the group)
    left = [len(group) for group in groups]
    for g, group in enumerate(groups):
        for i, problem in enumerate(group):
            request = Request(list(problem.prompt), max_new_tokens, stop_ids=stop_ids)
            try:
                engine.submit(request)
            except ValueError as err:  # the budget cannot hold this prompt's protected tokens
                out[g][i] = {"skipped": str(err), "prompt_tokens": len(problem.prompt)}
                left[g] -= 1
                continue
            where[request.id] = (g, i)
    mark = time.perf_counter()

    def complete(g: int) -> None:
        nonlocal mark
        now = time.perf_counter()
        if on_group is not None:
            on_group(g, out[g], now - mark)
        mark = now

    for g in range(len(groups)):
        if not left[g]:
            complete(g)
    with engine:
        while engine.has_work():
            for completion in engine.step():
                g, i = where[completion.request_id]
                out[g][i] = _record(groups[g][i], completion, tokenizer)
                left[g] -= 1
                if not left[g]:
                    complete(g)
    return out


def graded_tokens(
    task: Task, example: Example, token_ids: list[int], finish_reason: str | None, tokenizer: Any
) -> tuple[str, Grade]:
    """A generation's text and its grade, as the study grades it: the token ids decoded without
    special tokens, graded by the task, cut when the generation stopped at the length cap."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return text, task.evaluate(example, text, cut=finish_reason == "length")


def _record(problem: Problem, completion: Completion, tokenizer: Any) -> dict[str, Any]:
    ids, finish = completion.token_ids, completion.finish_reason
    _, grade = graded_tokens(problem.task, problem.example, ids, finish, tokenizer)
    return {
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
