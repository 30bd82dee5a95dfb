from __future__ import annotations

import pytest

from epikv.eval.extract import extract_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{5}.", "5"),
        (r"first \boxed{3} then \boxed{4}", "4"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{\text{(C)}}", r"\text{(C)}"),
        (r"\boxed{3\sqrt{2}}", r"3\sqrt{2}"),
        (r"the answer is $\boxed 5$.", "5"),
        (r"\boxed 025", "025"),
        (r"\fbox{12}", "12"),
        (r"\boxed {  7 }", "7"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{1{,}000}", "1{,}000"),
        ("The answer is 42.", None),
        ("", None),
        (r"\boxed{}", None),
        (r"\boxedx{5}", None),
        # A box cut off by the length cap does not count; the last complete one does.
        (r"\boxed{4} and then \boxed{\frac{1}{", "4"),
        (r"\boxed{\frac{1}{", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_no_fallback_to_last_number() -> None:
    assert extract_boxed("Therefore x = 17, final answer 17") is None


def test_gsm8k_flexible_fallback():
    from epikv.eval.extract import extract_final_number

    assert extract_final_number("so 3 + 4 = 7.\n#### 2,800\nThe answer is: 12") == "12"
    assert extract_final_number("She pays $18.\n#### $1,200") == "1,200"
    assert extract_final_number("Total is 5 apples and 12 pears, so 17.") == "17"
    assert extract_final_number("the box wins \\boxed{42} then 7") == "42"
    assert extract_final_number("no digits here") is None


def test_gsm8k_task_uses_fallback_but_math_does_not():
    from epikv.eval.tasks import load_task

    gsm, math = load_task("gsm8k"), load_task("math500")
    assert gsm.evaluate(gsm[0], "so she makes $18 a day.\nThe answer is: 18").correct
    assert not math.evaluate(math[0], "The answer is 3").correct
