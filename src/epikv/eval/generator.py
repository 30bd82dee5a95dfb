"""The seam between evaluation and the generation engine: what a generator is and how one is made.

This module owns the types the runner needs from the engine and nothing else: the generator's
contract (generate, check prompts, the spec and policy it resolved), the factories that make one for a
run, and the engine's `SamplingConfig` for a batch. It does not know about models, policies or
caches: the engine (:class:`epikv.generation.ChatGenerator`) is imported only when a run needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from epikv.eval.prompts import Messages

if TYPE_CHECKING:
    from epikv.engine import Completion
    from epikv.eval.config import EvalConfig
    from epikv.generation import SamplingConfig
    from epikv.spec import CacheSpec


class PromptFitLike(Protocol):
    """The attributes of `epikv.engine.PromptFit` that evaluation reads."""

    prompt_tokens: int
    problem: str | None
    min_budget: int | None


class Generator(Protocol):
    """Generates one completion per prompt with model, policy and budget already bound
    (:class:`epikv.generation.ChatGenerator`).

    ``fit`` says whether each prompt can run, before anything is generated; ``spec`` (None: not
    known) is the cache spec it runs, saved as the run's spec.json; ``resolved_policy`` (None: not
    known) is the policy as it resolved it, pinned across resumes in policy.json.
    """

    spec: CacheSpec | None
    resolved_policy: dict[str, Any] | None

    def __call__(self, prompts: list[Messages], sampling: SamplingConfig, /) -> Sequence[Completion]: ...

    def fit(self, prompts: list[Messages], /) -> Sequence[PromptFitLike]: ...


# run_eval asks for one generator per (policy, budget); None budget = no eviction.
GeneratorFactory = Callable[[str, "int | None"], Generator]
# The engine with the model bound: (policy, budget, interval, policy_params) -> generator; a run with
# rank_every (rho) set passes it as the keyword ``rank_every`` (and only then: engines from before it
# need not take it).
EngineFactory = Callable[..., Generator]


def engine_for_model(model_name: str | None, dtype: str = "float32") -> EngineFactory:
    """The engine's :func:`~epikv.generation.make_generator` with the model (in ``dtype``) bound
    (imported when called, so that argument parsing, reports and tests never load a model)."""

    def make(*args: Any, **kwargs: Any) -> Generator:
        from epikv.generation import make_generator

        return make_generator(model_name, *args, dtype=dtype, **kwargs)

    return make


def engine_for_config(config: EvalConfig) -> EngineFactory:
    """The engine a (resolved) config names: epikv's own (:func:`engine_for_model`), or vLLM with the
    epikv plugin (:class:`epikv.eval.vllm_generator.VllmGenerator`; a batch is one ``generate`` call
    with every prompt running at once)."""
    if config.engine == "epikv":
        return engine_for_model(config.model, dtype=config.dtype)
    from epikv.eval.vllm_generator import VllmGenerator

    if config.max_new_tokens is None:
        raise ValueError("engine vllm needs the run's max_new_tokens resolved against its task first")
    return partial(
        VllmGenerator,
        config.model,
        dtype=config.dtype,
        max_new_tokens=config.max_new_tokens,
        max_num_seqs=config.batch_size,
        enforce_eager=config.engine == "vllm",
        python=config.vllm_python,
    )


def generator_factory(engine: EngineFactory, config: EvalConfig) -> GeneratorFactory:
    """The engine with one run's interval, rank_every and policy parameters bound: what `run_eval`
    calls."""
    ranking = {} if config.rank_every is None else {"rank_every": config.rank_every}

    def for_run(policy: str, budget: int | None) -> Generator:
        return engine(policy, budget, config.interval, config.policy_params, **ranking)

    return for_run


def make_sampling(*, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> SamplingConfig:
    """The engine's `SamplingConfig` for one batch (imported here, when a run generates)."""
    from epikv.generation import SamplingConfig

    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
