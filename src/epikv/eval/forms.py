"""The form a problem asks its answer in, and whether an answer is in that form.

MATH problems often fix the form of the answer ("Express your answer as a common fraction", "in
simplest radical form", "as a decimal"). math-verify compares values, so it takes ``0.25`` where
``\\frac{1}{4}`` was asked and ``\\sqrt{117}`` for ``3\\sqrt{13}``; a grader of the problem as set
does not (issue 58). Owns the phrasings that ask for a form, as they occur in the shipped MATH-500
problems, and one small check per form. It knows nothing of extraction or of values: an answer in
the asked form is still graded for its value by ``grading.py``.

The checks, on the extracted answer's text:

- ``fraction`` ("as a common fraction", "as a fraction", "as an improper fraction", "as a mixed
  number", "simplest fractional form", "a simplified fraction", "a single fraction"): no decimal.
- ``decimal`` ("as a decimal", also "expressed as a decimal", "(as a decimal)"): no fraction
  (``\\frac``, ``\\dfrac``, ``\\tfrac`` or ``/``).
- ``radical`` ("simplest radical form"): no decimal, and every integer radicand free of square
  factors (of cube factors under a cube root, and so on). A root left in a denominator is not
  checked.
- ``exact`` ("in exact form"): no decimal.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

FRACTION, DECIMAL, RADICAL, EXACT = "fraction", "decimal", "radical", "exact"

_ASKED = (
    (
        FRACTION,
        re.compile(
            r"(?:common|improper|single|simplified) fraction|as a fraction|fractional form|mixed number",
            re.IGNORECASE,
        ),
    ),
    (DECIMAL, re.compile(r"as a decimal", re.IGNORECASE)),
    (RADICAL, re.compile(r"simplest radical form", re.IGNORECASE)),
    (EXACT, re.compile(r"in exact form", re.IGNORECASE)),
)
_DECIMAL = re.compile(r"\d\.\d|(?<![\d.])\.\d")
_FRACTION = re.compile(r"\\[dt]?frac(?![A-Za-z])|/")
# `\sqrt{117}`, `\sqrt 117`, `\sqrt[3]{16}`: the root's index (none: 2) and its integer radicand.
_ROOT = re.compile(r"\\sqrt\s*(?:\[\s*(\d+)\s*\])?\s*(?:\{\s*(\d+)\s*\}|(\d+))")
# Radicands above this are not factored (no such answer in the shipped problems): taken as simplest.
_LARGEST_FACTORED = 10**9


def asked_forms(problem: str) -> frozenset[str]:
    """The forms ``problem``'s text asks its answer in (empty: it asks for none)."""
    return frozenset(form for form, phrase in _ASKED if phrase.search(problem))


def _has_power_factor(number: int, index: int) -> bool:
    """Whether some p**index with p > 1 divides ``number`` (trial division; ``number`` <= 10**9)."""
    p = 2
    while p**index <= number:
        if number % p**index == 0:
            return True
        p += 1
    return False


def _simplest_radicals(answer: str) -> bool:
    for match in _ROOT.finditer(answer):
        index = int(match.group(1) or 2)
        radicand = int(match.group(2) or match.group(3))
        if radicand <= _LARGEST_FACTORED and (radicand in (0, 1) or _has_power_factor(radicand, index)):
            return False
    return True


def in_form(answer: str, form: str) -> bool:
    """Whether ``answer`` (an extracted answer's text) is in ``form`` (one of this module's forms)."""
    if form == DECIMAL:
        return _FRACTION.search(answer) is None
    if _DECIMAL.search(answer):
        return False
    return form != RADICAL or _simplest_radicals(answer)


def in_forms(answer: str | None, forms: Iterable[str]) -> bool:
    """Whether ``answer`` is in every one of ``forms`` (no answer is in none)."""
    forms = tuple(forms)
    if not forms:
        return True
    return answer is not None and all(in_form(answer, form) for form in forms)
