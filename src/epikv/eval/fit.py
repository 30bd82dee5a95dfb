"""Checking every selected prompt against a run's budget and the model's context before any work.

Issue #12: an eval stopped after three results when one problem's prompt did not fit a policy's
protected tokens, and the runs after it never ran. This module owns the check of one run's prompts
(:func:`check_fit`: which problems cannot run, why, and the smallest budget that fits them all), the
line that names them, and the error that stops an eval before anything is generated. The rules are
the engine's (:func:`epikv.engine.prompt_fit`), reached through the generator's ``fit`` (see
``generator.py``). It neither generates nor writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epikv.eval.generator import Generator
from epikv.eval.prompts import build_messages
from epikv.eval.tasks import Example

_SHOWN = 3  # problems named per run in the one-line summary


class UnfitPromptsError(ValueError):
    """Some selected prompts cannot run under some (policy, budget); nothing was generated."""


@dataclass(frozen=True)
class Unfit:
    """A problem whose prompt cannot run, and why."""

    example: Example
    prompt_tokens: int
    problem: str


@dataclass(frozen=True)
class FitReport:
    """One run's check. label: e.g. ``epikv K120``; checked: problems checked; min_budget: the
    smallest budget under which every checked prompt that fits the context also fits (None: the
    policy never evicts, or the generator cannot tell)."""

    label: str
    checked: int
    unfit: tuple[Unfit, ...]
    min_budget: int | None

    @property
    def unfit_ids(self) -> frozenset[str]:
        return frozenset(u.example.id for u in self.unfit)

    def describe(self) -> str:
        """``epikv K120: 2 of 8 problems (a, b) cannot run, e.g. a: <why>; the smallest budget that
        fits all 8 is 152``."""
        ids = ", ".join(u.example.id for u in self.unfit[:_SHOWN])
        more = ", …" if len(self.unfit) > _SHOWN else ""
        first = self.unfit[0]
        text = (
            f"{self.label}: {len(self.unfit)} of {self.checked} problems ({ids}{more}) cannot run, "
            f"e.g. {first.example.id}: {first.problem}"
        )
        if self.min_budget is not None:
            text += f"; the smallest budget that fits all {self.checked} is {self.min_budget}"
        return text


def check_fit(
    generator: Generator, examples: Sequence[Example], system_prompt: str | None, label: str
) -> FitReport:
    """Checks each example's prompt (as the runner will send it) with ``generator.fit``."""
    if not examples:
        return FitReport(label, 0, (), None)
    fits = list(generator.fit([build_messages(example.problem, system_prompt) for example in examples]))
    if len(fits) != len(examples):
        raise RuntimeError(f"generator checked {len(fits)} prompts for {len(examples)}")
    unfit = tuple(
        Unfit(example, f.prompt_tokens, f.problem)
        for example, f in zip(examples, fits, strict=True)
        if f.problem is not None
    )
    budgets = [f.min_budget for f in fits if f.min_budget is not None]
    return FitReport(label, len(examples), unfit, max(budgets) if budgets else None)


def unfit_error(reports: Sequence[FitReport]) -> UnfitPromptsError:
    """The one-line error naming the first problems of every run that has some."""
    parts = "; ".join(report.describe() for report in reports if report.unfit)
    return UnfitPromptsError(
        f"nothing was generated: {parts}. Use a larger --budget, or pass --skip-unfit to record "
        "these problems as skipped (counted apart, never as wrong)"
    )
