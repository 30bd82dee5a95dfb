"""The decode engine: a scheduler that admits requests by KV slots, the budgeted cache that keeps
their rows, a runner that executes one forward, and the :class:`Engine` that drives them.
Every decode in epikv runs here (see :mod:`epikv.engine.engine`)."""

from epikv.engine.engine import Engine, PromptFit, PromptTooLong, prompt_fit
from epikv.engine.request import Completion, Request, SamplingParams
from epikv.engine.scheduler import PoolTooSmall, QueueFull, Scheduler, SchedulerLimits
from epikv.spec import BudgetTooSmall

__all__ = [
    "BudgetTooSmall",
    "Completion",
    "Engine",
    "PoolTooSmall",
    "PromptFit",
    "PromptTooLong",
    "QueueFull",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SchedulerLimits",
    "prompt_fit",
]
