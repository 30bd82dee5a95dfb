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
