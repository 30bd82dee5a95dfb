"""The forms a MATH problem asks its answer in, and their checks (issue 58)."""

from __future__ import annotations

import pytest

from epikv.eval.forms import DECIMAL, EXACT, FRACTION, RADICAL, asked_forms, in_form, in_forms
from epikv.eval.tasks import load_task

MATH = {e.id: e for e in load_task("math500")}


@pytest.mark.parametrize(
    ("problem_id", "forms"),
    [
        ("test/algebra/2584.json", {FRACTION}),  # "Express your answer as a common fraction."
        ("test/algebra/2036.json", {RADICAL}),  # "in simplest radical form"
        ("test/algebra/2253.json", {FRACTION, RADICAL}),  # "as a common fraction in simplest radical form"
        ("test/prealgebra/572.json", {DECIMAL}),  # "Write $\frac{3}{20}$ as a decimal."
        ("test/algebra/621.json", {DECIMAL}),  # "(as a decimal)"
        ("test/geometry/826.json", {FRACTION}),  # "as a mixed number"
        ("test/algebra/972.json", {FRACTION}),  # "as an improper fraction"
        ("test/prealgebra/1512.json", {EXACT}),  # "in exact form"
        ("test/number_theory/1090.json", set()),  # "gives a terminating decimal": asks no form
        ("test/precalculus/807.json", set()),
    ],
)
def test_asked_forms_read_the_problems_phrasings(problem_id: str, forms: set[str]) -> None:
    assert asked_forms(MATH[problem_id].problem) == forms


@pytest.mark.parametrize(
    ("answer", "form", "expected"),
    [
        (r"\frac{1}{4}", FRACTION, True),
        ("0.25", FRACTION, False),
        (".25", FRACTION, False),
        (r"1\frac{4}{5}", FRACTION, True),
        ("4.5", DECIMAL, True),
        (r"\frac{9}{2}", DECIMAL, False),
        (r"\dfrac92", DECIMAL, False),
        ("9/2", DECIMAL, False),
        (r"3\sqrt{13}", RADICAL, True),
        (r"\sqrt{117}", RADICAL, False),  # 117 = 9 x 13
        (r"\sqrt 8", RADICAL, False),
        (r"\sqrt{4}", RADICAL, False),
        (r"\frac{3\sqrt{3}}{4}", RADICAL, True),
        (r"\sqrt[3]{16}", RADICAL, False),  # 16 = 8 x 2
        (r"\sqrt[3]{12}", RADICAL, True),  # 12 = 4 x 3 has no cube factor
        ("10.8167", RADICAL, False),
        (r"7\pi", EXACT, True),
        ("21.99", EXACT, False),
    ],
)
def test_in_form(answer: str, form: str, expected: bool) -> None:
    assert in_form(answer, form) is expected


def test_no_form_asked_takes_any_answer_and_no_answer_is_in_none() -> None:
    assert in_forms("0.25", ())
    assert not in_forms(None, (FRACTION,))
    assert not in_forms(r"\frac{3}{\sqrt{117}}", (FRACTION, RADICAL))


def test_every_math500_gold_answer_is_in_the_forms_its_problem_asks() -> None:
    asking = [e for e in MATH.values() if asked_forms(e.problem)]
    assert len(asking) == 37
    assert all(in_forms(e.answer, asked_forms(e.problem)) for e in asking)


@pytest.mark.parametrize(
    ("problem_id", "value_only", "as_asked"),
    [
        ("test/counting_and_probability/803.json", "0.25", r"\frac{1}{4}"),
        ("test/algebra/2036.json", r"\sqrt{117}", r"3\sqrt{13}"),
        ("test/prealgebra/2019.json", r"\frac{9}{2}", "4.5"),
    ],
)
def test_math500_grades_the_form_asked_not_only_the_value(
    problem_id: str, value_only: str, as_asked: str
) -> None:
    task, example = load_task("math500"), MATH[problem_id]
    assert task.evaluate(example, f"so \\boxed{{{as_asked}}}.").correct
    assert not task.evaluate(example, f"so \\boxed{{{value_only}}}.").correct
