from __future__ import annotations

import json
from pathlib import Path

import pytest

from epikv.eval.tasks import (
    Example,
    Task,
    examples_from_hub_rows,
    hub_answer,
    load_hub_task,
    load_task,
    parse_hub_spec,
)


@pytest.mark.parametrize(
    ("name", "count", "cap", "first_id"),
    [
        ("math500", 500, 8192, "test/precalculus/807.json"),
        ("aime2024", 30, 16384, "2024-I-1"),
        ("amc2023", 40, 8192, "2023-12A-1"),
        ("gsm8k", 1319, 8192, "gsm8k-0000"),
    ],
)
def test_builtin_counts_caps_and_ids(name: str, count: int, cap: int, first_id: str) -> None:
    task = load_task(name)
    assert len(task) == count
    assert task.max_new_tokens == cap
    assert task[0].id == first_id
    assert [e.index for e in task] == list(range(count))


def test_slicing_keeps_original_indices() -> None:
    task = load_task("gsm8k").slice(offset=10, limit=5)
    assert len(task) == 5
    assert [e.index for e in task] == [10, 11, 12, 13, 14]
    assert task[0].id == "gsm8k-0010"
    assert len(load_task("aime2024").slice(offset=25)) == 5
    assert len(load_task("aime2024").slice(offset=40)) == 0
    assert [e.id for e in task.slice(1, 2)] == ["gsm8k-0011", "gsm8k-0012"]


def test_evaluate_extracts_and_grades() -> None:
    task = load_task("gsm8k")
    first = task[0]  # gold 18
    assert task.evaluate(first, r"... so \boxed{\$18.00}").correct
    grade = task.evaluate(first, "I think it is 18.")  # GSM8K's flexible fallback: the last number
    assert grade.extracted == "18" and grade.correct
    math = load_task("math500")
    grade = math.evaluate(math[0], "I think it is 3.")
    assert grade.extracted is None and not grade.correct
    negative = next(e for e in task if e.answer == "-10")
    assert task.evaluate(negative, r"\boxed{-10}").correct
    assert not task.evaluate(negative, r"\boxed{10}").correct


def test_evaluate_does_not_credit_the_last_number_of_a_generation_cut_at_the_cap() -> None:
    task = load_task("gsm8k")
    first = task[0]  # gold 18
    text = "She sells 16 - 3 - 4 = 9 eggs at $2, so 9 x 2 = 18"
    assert task.evaluate(first, text).correct
    cut = task.evaluate(first, text, cut=True)
    assert cut.extracted is None and not cut.correct
    assert task.evaluate(first, text + ".\nThe answer is 18. Let me check", cut=True).correct


def test_gold_answers_verify_against_themselves() -> None:
    for name in ("aime2024", "amc2023"):
        task = load_task(name)
        assert all(task.evaluate(e, f"\\boxed{{{e.answer}}}").correct for e in task)
    math = load_task("math500").slice(limit=40)
    assert all(math.evaluate(e, f"\\boxed{{{e.answer}}}").correct for e in math)


def test_jsonl_path_task(tmp_path: Path) -> None:
    path = tmp_path / "my set.jsonl"
    rows = [{"problem": "1+1?", "answer": "2"}, {"id": "x", "problem": "2+2?", "answer": "4"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    task = load_task(str(path))
    assert task.name == "my-set"
    assert [e.id for e in task] == ["0", "x"]
    assert task.max_new_tokens == 8192


def test_jsonl_path_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "p"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="answer"):
        load_task(str(path))
    with pytest.raises(FileNotFoundError):
        load_task(str(tmp_path / "missing.jsonl"))


def test_unknown_name_suggests_the_close_one() -> None:
    with pytest.raises(ValueError, match="did you mean 'math500'"):
        load_task("math50")


def test_duplicate_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate example id 'a'"):
        Task("t", [Example("a", "p", "1", 0), Example("a", "q", "2", 1)])


def test_hub_spec_and_row_mapping() -> None:
    assert parse_hub_spec("hf:HuggingFaceH4/MATH-500").split == "test"
    spec = parse_hub_spec("hf:openai/gsm8k:main:test")
    assert (spec.dataset, spec.config, spec.split) == ("openai/gsm8k", "main", "test")
    assert spec.task_name == "hf-openai-gsm8k"
    with pytest.raises(ValueError, match="hf:NAME"):
        parse_hub_spec("hf:a:b:c:d")
    assert hub_answer("She pays 2 + 3 = 5\n#### 1,234") == "1234"
    rows = [{"question": "q1", "answer": "x\n#### 5"}, {"problem": "q2", "answer": "7", "unique_id": "u"}]
    examples = examples_from_hub_rows(rows, "hf-x")
    assert [(e.id, e.problem, e.answer) for e in examples] == [("hf-x-0000", "q1", "5"), ("u", "q2", "7")]


def test_hub_without_datasets_package_is_a_clear_error() -> None:
    try:
        import datasets  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(ImportError, match="pip install datasets"):
            load_hub_task("hf:HuggingFaceH4/MATH-500")
    else:
        pytest.skip("datasets is installed; the offline error path cannot be exercised")


def test_a_shuffled_builtin_task_is_a_fixed_seeded_order_whose_prefixes_are_samples():
    import hashlib

    from epikv.eval.tasks import load_builtin, load_task

    whole = load_builtin("gsm8k")
    task = load_task("gsm8k:shuffle=3")
    assert task.name == "gsm8k-shuffle3" and task.grader == whole.grader and len(task) == len(whole)
    expected = sorted(whole, key=lambda e: hashlib.sha256(f"3:{e.id}".encode()).hexdigest())
    assert [e.id for e in task] == [e.id for e in expected]
    assert [e.index for e in task][:3] == [int(e.id.split("-")[1]) for e in expected[:3]]  # full-set index
    assert {e.id for e in task} == {e.id for e in whole}
    assert [e.id for e in load_task("gsm8k:shuffle=3").slice(0, 50)] == [e.id for e in task][:50]
    assert [e.id for e in load_task("gsm8k:shuffle=4")][:20] != [e.id for e in task][:20]
    with pytest.raises(ValueError, match=r"only shuffle=SEED"):
        load_task("gsm8k:shuffle=x")
