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
        # A box cut open by the length cap is no answer, and an earlier complete box does not
        # stand in for it (issue 58): the final answer was cut.
        (r"\boxed{4} and then \boxed{\frac{1}{", None),
        (r"\boxed{\frac{1}{", None),
        (r"\boxed{2} so far; the total is \boxed{2", None),
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


def test_gsm8k_a_box_cut_open_is_no_answer_even_after_a_complete_box() -> None:
    from epikv.eval.extract import extract_final_number

    # Before issue 58 the earlier box (2) was taken, and without a box the last number (24).
    assert extract_final_number("so \\boxed{2} apples, then 3 x 8 = 24 and \\boxed{2") is None
    assert extract_final_number("3 x 8 = 24, so \\boxed{2") is None
    assert extract_final_number("3 x 8 = 24, so \\boxed{2", cut=True) is None


def test_gsm8k_a_generation_cut_at_the_cap_is_not_credited_its_last_number() -> None:
    from epikv.eval.extract import extract_final_number

    cut_text = "She has 3 bags of 8 apples, so 3 x 8 = 24"
    assert extract_final_number(cut_text) == "24"  # finished (eos): the flexible fallback stands
    assert extract_final_number(cut_text, cut=True) is None
    # A final-answer marker still counts when the cap fell after it.
    assert extract_final_number("The answer is 24. Let me check: 3 x 8", cut=True) == "24"
    assert extract_final_number("#### 24\nCheck: 3 x", cut=True) == "24"
    assert extract_final_number("so \\boxed{24}. Check: 3 x 8 = 2", cut=True) == "24"
