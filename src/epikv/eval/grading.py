"""Grading an extracted answer against a gold answer.

Owns the comparison, not the extraction (see `extract.py`) and not the dataset (see `tasks.py`).
`grade_math` defers to math-verify; `grade_numeric` adds the GSM8K normalisation (commas, dollar
signs, trailing `.0`, unit words) and falls back to `grade_math` for anything that is not a plain number.

math-verify guards parsing and comparison with `signal.alarm`, which raises outside the main thread.
Its `parsing_timeout` / `timeout_seconds` parameters accept None to switch the alarm off, so in
worker threads we pass None and rely on only ever handing it short strings (a single box content).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

Grader = Callable[["str | None", str], bool]

# Seconds math-verify may spend per parse/compare when it can use signal.alarm (main thread only).
MAIN_THREAD_TIMEOUT_S = 5

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_LATEX_SPACING = re.compile(r"\\[,!;: ]")
_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NUMBER_WITH_UNITS = re.compile(r"^(-?(?:\d+\.?\d*|\.\d+))(?:\s*[A-Za-z][A-Za-z .]*)?$")


def _math_verify_timeout() -> int | None:
    on_main = threading.current_thread() is threading.main_thread()
    return MAIN_THREAD_TIMEOUT_S if on_main else None


def grade_math(extracted: str | None, gold: str) -> bool:
    """True when math-verify judges `\\boxed{extracted}` equal to the gold answer.

    The gold is wrapped as `$gold$`: bare LaTeX such as `3\\sqrt{2}` is otherwise not recognised as
    LaTeX and verifies false against itself (see data/README.md, "Grading note").
    """
    if extracted is None:
        return False
    try:
        from math_verify import parse, verify
    except ModuleNotFoundError as err:
        raise ImportError("grading needs math-verify: pip install 'epikv[eval]'") from err
    timeout = _math_verify_timeout()
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{extracted}}}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def normalize_number(answer: str) -> str | None:
    """Canonical decimal string of a plain numeric answer, or None when it is not one.

    Strips `$`/`\\$`, `%`, LaTeX spacing, `\\text{...}` wrappers, thousands commas and trailing
    unit words ("18 dollars"); `18.00` becomes `18`. Fractions and expressions return None.
    """
    text = _TEXT_WRAPPER.sub(r" \1 ", answer)
    text = _LATEX_SPACING.sub("", text)
    text = text.replace("{,}", ",").replace("\\$", "").replace("$", "")
    text = text.replace("\\%", "").replace("%", "")
    text = _DIGIT_COMMA.sub("", text).strip().rstrip(".").strip()
    match = _NUMBER_WITH_UNITS.match(text)
    if match is None:
        return None
    try:
        value = Decimal(match.group(1))
    except InvalidOperation:
        return None
    canonical = format(value.normalize(), "f")
    return "0" if canonical == "-0" else canonical


def grade_numeric(extracted: str | None, gold: str) -> bool:
    """Exact numeric comparison after `normalize_number`; math-verify when either side is not a number."""
    if extracted is None:
        return False
    pred_number = normalize_number(extracted)
    gold_number = normalize_number(gold)
    if pred_number is not None and gold_number is not None:
        return Decimal(pred_number) == Decimal(gold_number)
    return grade_math(extracted, gold)


GRADERS: dict[str, Grader] = {"math": grade_math, "numeric": grade_numeric}
