from __future__ import annotations

import threading

import pytest

from epikv.eval.grading import grade_math, grade_numeric, normalize_number


@pytest.mark.parametrize(
    ("extracted", "gold", "expected"),
    [
        (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)", True),
        (r"(3, \frac{\pi}{3})", r"\left( 3, \frac{\pi}{2} \right)", False),
        (r"\text{Evelyn}", r"\text{Evelyn}", True),
        (r"\text{(C)}", r"\text{(C)}", True),
        (r"\text{(D)}", r"\text{(C)}", False),
        (r"3\sqrt{2}", r"3\sqrt{2}", True),
        (r"\sqrt{18}", r"3\sqrt{2}", True),
        (r"2\sqrt{3}", r"3\sqrt{2}", False),
        (r"\dfrac{14}{3}", r"\frac{14}{3}", True),
        ("p-q", "p - q", True),
        ("q-p", "p - q", False),
        ("025", "25", True),  # AIME answers written with a leading zero
        ("33", "25", False),
        (None, "25", False),
    ],
)
def test_grade_math(extracted: str | None, gold: str, expected: bool) -> None:
    assert grade_math(extracted, gold) is expected


def test_gold_must_be_wrapped_to_avoid_false_negatives() -> None:
    # The reason grade_math wraps the gold in $...$ (data/README.md): bare LaTeX is not parsed.
    from math_verify import parse, verify

    assert not verify(parse(r"3\sqrt{2}"), parse(r"\boxed{3\sqrt{2}}"))
    assert grade_math(r"3\sqrt{2}", r"3\sqrt{2}")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("18", "18"),
        ("-10", "-10"),
        ("1,000", "1000"),
        ("1{,}234{,}567", "1234567"),
        (r"\$18.00", "18"),
        ("$5", "5"),
        ("18.0", "18"),
        ("0.50", "0.5"),
        ("18 dollars", "18"),
        (r"18 \text{ eggs}", "18"),
        (r"25\%", "25"),
        ("3/4", None),
        (r"\frac{3}{4}", None),
        ("12,34", None),
    ],
)
def test_normalize_number(answer: str, expected: str | None) -> None:
    assert normalize_number(answer) == expected


@pytest.mark.parametrize(
    ("extracted", "gold", "expected"),
    [
        ("-10", "-10", True),
        ("10", "-10", False),
        ("1,080", "1080", True),
        (r"\$1,080.00", "1080", True),
        ("70 dollars", "70", True),
        ("70.5", "70", False),
        (r"\frac{36}{2}", "18", True),  # not a plain number: math-verify decides
        (None, "18", False),
    ],
)
def test_grade_numeric(extracted: str | None, gold: str, expected: bool) -> None:
    assert grade_numeric(extracted, gold) is expected


def test_grading_from_a_worker_thread() -> None:
    # math-verify's default timeouts use signal.alarm, which raises ValueError off the main thread.
    outcomes: list[object] = []

    def work() -> None:
        try:
            outcomes.append(
                (
                    grade_math(r"\sqrt{18}", r"3\sqrt{2}"),
                    grade_math("4", "5"),
                    grade_numeric(r"\frac{36}{2}", "18"),
                )
            )
        except Exception as err:  # surfaced below; a thread would otherwise swallow it
            outcomes.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert outcomes == [(True, False, True)]
