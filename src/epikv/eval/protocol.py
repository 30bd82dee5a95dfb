"""The seam between evaluation and the generation engine.

This module owns the types the runner needs from the engine and nothing else: the shape of a
chat prompt, the generator callable, and how to build the engine's `SamplingConfig`. It does not
know about models, policies or caches; the CLI binds those into a generator before the runner sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from epikv.generation import SamplingConfig

Messages = list[dict[str, str]]


class SequenceResultLike(Protocol):
    """The attributes of `epikv.generation.SequenceResult` that evaluation reads."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    tokens_generated: int
    finish_reason: str
    peak_cache_tokens: int
    final_cache_tokens: int
    evictions: int
    seconds: float
    mean_cache_tokens: float | None


class PromptFitLike(Protocol):
    """The attributes of `epikv.engine.PromptFit` that evaluation reads."""

    prompt_tokens: int
    problem: str | None
    min_budget: int | None


class Generator(Protocol):
    """Generates one completion per prompt with model, policy and budget already bound.

    The engine's generators also have ``fit(prompts) -> Sequence[PromptFitLike]``, which says
    whether each prompt can run, before anything is generated; evaluation uses it when present.
    """

    def __call__(
        self, prompts: list[Messages], sampling: SamplingConfig, /
    ) -> Sequence[SequenceResultLike]: ...


# run_eval asks for one generator per (policy, budget); None budget = no eviction.
GeneratorFactory = Callable[[str, "int | None"], Generator]
# What the engine exposes: make_generator(model_name, ...) with the model name already bound.
EngineFactory = Callable[[str, "int | None", "int | None", dict[str, Any]], Generator]


@dataclass(frozen=True)
class _LocalSampling:
    """Field-for-field stand-in for `epikv.generation.SamplingConfig`.

    Used only when the engine module is absent (tests, partial checkouts), so that evaluation can be
    exercised with fake generators. The engine's own class is always preferred when importable.
    """

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0


def make_sampling(*, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> SamplingConfig:
    """Builds the engine's `SamplingConfig`, or the local stand-in when the engine is not installed."""
    try:
        from epikv.generation import SamplingConfig
    except ModuleNotFoundError as err:
        # Only the engine module itself being missing is expected; anything else is a real bug.
        if err.name != "epikv.generation":
            raise
        sampling: Any = _LocalSampling(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        return sampling
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
