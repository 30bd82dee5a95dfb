"""Fake generators standing in for the engine: scripted answers, and a log of every call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from epikv.engine import Completion, PromptFit, prompt_fit
from epikv.eval.prompts import Messages
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec


@dataclass
class FakeResult(Completion):
    """The engine's record of a finished sequence (text set, as ``generate`` returns it), with
    defaults for everything a test does not script."""

    request_id: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "eos"
    prompt_tokens: int = 10
    peak_cache_tokens: int = 0
    final_cache_tokens: int = 0
    evictions: int = 0
    compactions: int = 0
    first_evicted_index: int | None = None
    prefill_seconds: float = 0.0
    seconds: float = 1.0


def boxed(answer: str, n_tokens: int = 20) -> FakeResult:
    return FakeResult(
        text=f"Reasoning... so the answer is \\boxed{{{answer}}}.", token_ids=list(range(n_tokens))
    )


# A model shape for specs built without a model (the fakes check prompts with the engine's rules).
FAKE_MODEL = ModelInfo("fake", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)


def fake_spec(policy: str = "random", budget: int | None = 512) -> CacheSpec:
    return CacheSpec.build(FAKE_MODEL, policy, budget)


def word_count(messages: Messages) -> int:
    """The fakes' tokenizer: one token per word of every message."""
    return sum(len(message["content"].split()) for message in messages)


@dataclass
class FakeGenerator:
    """Answers each prompt with `respond(problem)`; records the problems and sampling of each call.
    With a `spec`, `fit` checks prompts (one token per word) by the engine's rules, as the real
    generator does; without one every prompt fits."""

    respond: Callable[[str], FakeResult]
    calls: list[tuple[list[str], Any]] = field(default_factory=list)
    fail_after_calls: int | None = None
    spec: CacheSpec | None = None
    context_length: int | None = None
    resolved_policy: dict[str, Any] | None = None

    def fit(self, prompts: list[Messages]) -> list[PromptFit]:
        if self.spec is None:
            return [PromptFit(word_count(messages)) for messages in prompts]
        return [prompt_fit(self.spec, self.context_length, word_count(messages)) for messages in prompts]

    @property
    def problems_asked(self) -> list[str]:
        return [problem for problems, _ in self.calls for problem in problems]

    def __call__(self, prompts: list[Messages], sampling: Any) -> Sequence[FakeResult]:
        if self.fail_after_calls is not None and len(self.calls) >= self.fail_after_calls:
            raise KeyboardInterrupt("simulated kill")
        problems = [messages[-1]["content"] for messages in prompts]
        self.calls.append((problems, sampling))
        return [self.respond(problem) for problem in problems]


@dataclass
class FakeFactory:
    """A GeneratorFactory that hands out one shared FakeGenerator and records what it was asked for."""

    generator: FakeGenerator
    requested: list[tuple[str, int | None]] = field(default_factory=list)

    def __call__(self, policy: str, budget: int | None) -> FakeGenerator:
        self.requested.append((policy, budget))
        return self.generator
