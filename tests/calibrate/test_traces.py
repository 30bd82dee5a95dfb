"""Answer start rules and answer keys on a character-level 'tokenizer'."""

from __future__ import annotations

import pytest

from epikv.calibrate.traces import Trace, answer_key, find_answer_start, load_traces, make_trace, save_traces


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(tokens: list[int]) -> str:
    return "".join(chr(t) for t in tokens)


@pytest.mark.parametrize(
    ("text", "rule", "answer_text"),
    [
        ("so x=2 </think> The answer is \\boxed{2}.", "think", " The answer is \\boxed{2}."),
        ("try \\boxed{1} no, \\boxed{2} yes", "boxed", "\\boxed{2} yes"),
        ("a" * 80 + "#### 18\nThe answer is: 18", "marker", "#### 18\nThe answer is: 18"),
        ("The answer is 3" + "b" * 80 + " the ANSWER is 4", "marker", "the ANSWER is 4"),
        ("c" * 100, "tail", "c" * 64),
    ],
)
def test_answer_start_rules(text, rule, answer_text):
    start, found = find_answer_start(ids(text), decode)
    assert found == rule
    assert decode(ids(text)[start:]) == answer_text


def test_markers_can_be_switched_off():
    text = "a" * 80 + "#### 18"
    start, rule = find_answer_start(ids(text), decode, markers=())
    assert (rule, start) == ("tail", len(text) - 64)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("so \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),
        ("#### 1,080\nThe answer is: 1080.00", "1080"),
        ("It costs $18 per day.", "18"),
        ("went down by -3.5 degrees", "-3.5"),
        ("no numbers here", None),
        ("\\boxed{ 12 }", "12"),
    ],
)
def test_answer_key(text, key):
    assert answer_key(text) == key


def test_make_trace_strips_eos_and_grades(tmp_path):
    prompt = ids("Q?")
    generated = [*ids("x" * 70 + "#### 5"), 0]
    trace = make_trace("t1", prompt, generated, [0], decode, grade=lambda key: key == "5", gold="5")
    assert trace.finished and trace.output_ids == generated[:-1]
    assert trace.answer == "5" and trace.correct is True and trace.answer_rule == "marker"
    assert trace.span == (2, 2 + 70)
    cut = make_trace("t2", prompt, ids("y" * 10), [0], decode)
    assert not cut.finished and cut.correct is None
    save_traces([trace, cut], tmp_path / "traces.jsonl")
    assert load_traces(tmp_path / "traces.jsonl") == [trace, cut]
    assert isinstance(load_traces(tmp_path / "traces.jsonl")[0], Trace)
