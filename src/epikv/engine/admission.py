"""The gate every request passes once: does it fit this engine at all, and how many slots it reserves.

:class:`Admission` answers in one call, before any compute, from the spec and the engine's sizes
alone (the model's context, its sliding-window rings, the KV pool): the request's own budget within
1..K, a prompt within the model's context, and a reservation within the pool (a prompt whose
protected tokens, the prompt or the sinks plus the recent window, pass its K runs at the smallest K
that holds them: :meth:`~epikv.spec.CacheSpec.prompt_budget`). What does not fit raises one of the
:class:`~epikv.errors.AdmissionError` family, naming the request's field to blame; what fits gets
its reservation in cache slots, which the engine queues with the request and keeps on its running
row. Whether it fits *now* (free slots, batch room, queue room) is the scheduler's.
:func:`prompt_fit` is the same prompt rules as data, for callers that check many prompts at once.
It knows no model, no tensors and no queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from epikv.engine.request import Request
from epikv.errors import BudgetTooSmall, PoolTooSmall, PromptTooLong
from epikv.spec import CacheSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptFit:
    """Whether a prompt can run: its length, why not (None when it can), and the smallest budget that
    holds its protected tokens (None for a spec that never evicts, or when no budget helps)."""

    prompt_tokens: int
    problem: str | None = None
    min_budget: int | None = None


def check_context(context_length: int | None, prompt_tokens: int) -> None:
    """Raise :class:`PromptTooLong` for a prompt longer than the model's context (no budget helps)."""
    if context_length is not None and prompt_tokens > context_length:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens but the model's context is {context_length} tokens"
        )


def check_prompt(spec: CacheSpec, context_length: int | None, prompt_tokens: int, budget: int | None) -> None:
    """The strict rule of comparisons at equal K (``epikv eval``): raise :class:`PromptTooLong` (see
    :func:`check_context`) or :class:`BudgetTooSmall` (protected tokens over ``budget``, a request's
    own K; None = the spec's). The engine itself runs such a prompt at a raised K
    (:meth:`~epikv.spec.CacheSpec.prompt_budget`)."""
    check_context(context_length, prompt_tokens)
    spec.check_prompt(prompt_tokens, budget)


def prompt_fit(
    spec: CacheSpec, context_length: int | None, prompt_tokens: int, budget: int | None = None
) -> PromptFit:
    """:func:`check_prompt` as data, so callers can check many prompts before any compute."""
    smallest = spec.min_budget(prompt_tokens) if spec.evicts else None
    try:
        check_prompt(spec, context_length, prompt_tokens, budget)
    except PromptTooLong as error:
        return PromptFit(prompt_tokens, str(error))
    except BudgetTooSmall as error:
        return PromptFit(prompt_tokens, str(error), smallest)
    return PromptFit(prompt_tokens, None, smallest)


@dataclass(frozen=True)
class Admission:
    """The gate of one engine. context_length: the model's (None = unbounded); window_slots: a row's
    sliding-window rings, in pool slots (0 without sliding layers); kv_pool: slots all running
    requests may reserve together (None = unlimited)."""

    spec: CacheSpec
    context_length: int | None = None
    window_slots: int = 0
    kv_pool: int | None = None

    def __post_init__(self) -> None:
        if self.window_slots < 0:
            raise ValueError(f"window_slots must be >= 0, got {self.window_slots}")

    def check(self, request: Request) -> int:
        """The slots ``request`` reserves: the most its evicting layers can ever hold (the spec's
        peak at its budget, raised for a prompt whose protected tokens pass it) plus its
        sliding-window rings. Raises an :class:`AdmissionError` (BudgetOutOfRange, PromptTooLong,
        PoolTooSmall) for a request that no wait would admit."""
        self.spec.row_budget(request.budget)
        tokens, new = request.prompt_tokens, request.max_new_tokens
        check_context(self.context_length, tokens)
        context = self.context_length
        if context is not None and tokens + new > context:
            log.warning(
                "request %s: %d prompt + %d new tokens run past the model's context of %d",
                *(request.id, tokens, new, context),
            )
        slots = self.spec.peak_tokens(tokens, new, request.budget) + self.window_slots
        if self.kv_pool is not None and slots > self.kv_pool:
            raise PoolTooSmall(
                f"the request needs {slots} cache slots but the whole KV pool holds {self.kv_pool}"
            )
        return slots
