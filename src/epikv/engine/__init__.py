"""The decode engine: a gate that answers once whether a request fits, a scheduler that admits
requests by KV slots, the budgeted cache that keeps their rows, a runner that executes one forward,
and the :class:`Engine` that drives them. Every decode in epikv runs here (see
:mod:`epikv.engine.engine`). The admission errors are :mod:`epikv.errors`' family, re-exported."""

from epikv.engine.admission import Admission, PromptFit, prompt_fit
from epikv.engine.engine import Engine
from epikv.engine.request import Completion, Request, SamplingParams
from epikv.engine.scheduler import Scheduler, SchedulerLimits
from epikv.errors import (
    AdmissionError,
    BudgetOutOfRange,
    BudgetTooSmall,
    PoolTooSmall,
    PromptTooLong,
    QueueFull,
)

__all__ = [
    "Admission",
    "AdmissionError",
    "BudgetOutOfRange",
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
