"""The fidelity genres: the shipped records and the prompt/continuation split, on a character tokenizer."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from epikv.bench.fidelity.genres import GENRES, genre_texts, load_genre
from epikv.eval.prompts import PAPER_SYSTEM_PROMPT
from tests.helpers.tokenizer import CharTokenizer, ChatCharTokenizer


def text_of(ids) -> str:
    return CharTokenizer(fold=None).decode(ids)


def test_the_five_genres_and_which_are_forced():
    assert list(GENRES) == ["math500-solutions", "prose", "code", "gsm8k-greedy", "math500-greedy"]
    assert [g.forced for g in GENRES.values()] == [True, True, True, False, False]


@pytest.mark.parametrize("name", ["prose", "code", "math500-solutions"])
def test_forced_items_split_the_raw_passage(name):
    items = load_genre(name, CharTokenizer(fold=None), prompt_tokens=10, trace_tokens=25, count=4)
    texts = dict(genre_texts(name))
    for item in items:
        assert item.forced and item.trace_tokens == 25
        assert len(item.prompt_ids) == 10 and len(item.continuation_ids) == 25
        assert text_of(item.prompt_ids + item.continuation_ids) == texts[item.id][:35]


def test_math_passage_is_problem_then_solution_and_short_ones_are_skipped():
    records = [json.loads(line) for line in resources.files("epikv").joinpath("data", "math500.jsonl").open()]
    assert genre_texts("math500-solutions")[0][1] == records[0]["problem"] + "\n\n" + records[0]["solution"]
    long_enough = [r["id"] for r in records if len(r["problem"]) + 2 + len(r["solution"]) >= 2000]
    items = load_genre("math500-solutions", CharTokenizer(fold=None), prompt_tokens=500, trace_tokens=1500)
    assert [item.id for item in items] == long_enough and 0 < len(items) < len(records)


def test_offset_and_count_take_a_window_of_the_eligible_items():
    tok = CharTokenizer(fold=None)
    every = load_genre("code", tok, prompt_tokens=8, trace_tokens=8)
    assert [i.id for i in load_genre("code", tok, prompt_tokens=8, trace_tokens=8, count=3, offset=2)] == [
        i.id for i in every[2:5]
    ]
    with pytest.raises(ValueError, match="has 48 items of at least 16 tokens; asked for 3 after offset 46"):
        load_genre("code", tok, prompt_tokens=8, trace_tokens=8, count=3, offset=46)


def test_greedy_genres_give_the_chat_prompt_and_no_continuation():
    problem = genre_texts("gsm8k-greedy")[0][1]
    (item,) = load_genre("gsm8k-greedy", ChatCharTokenizer(fold=None), trace_tokens=512, count=1)
    assert not item.forced and item.continuation_ids is None and item.trace_tokens == 512
    assert text_of(item.prompt_ids) == f"<system>{PAPER_SYSTEM_PROMPT}<user>{problem}<assistant>"
    (plain,) = load_genre("math500-greedy", ChatCharTokenizer(fold=None), count=1, chat=False)
    assert text_of(plain.prompt_ids) == genre_texts("math500-greedy")[0][1]
    (no_template,) = load_genre("gsm8k-greedy", CharTokenizer(fold=None), count=1)
    assert text_of(no_template.prompt_ids) == problem


def test_bad_requests_are_named():
    with pytest.raises(ValueError, match="did you mean 'prose'"):
        load_genre("pros", CharTokenizer(fold=None))
    with pytest.raises(ValueError, match="prompt_tokens >= 1"):
        load_genre("prose", CharTokenizer(fold=None), prompt_tokens=0)
    with pytest.raises(ValueError, match="has 0 items"):
        load_genre("prose", CharTokenizer(fold=None), prompt_tokens=10**6)


@pytest.mark.parametrize("name, licenses", [("prose", {"public-domain"}), ("code", {"MIT", "BSD-3-Clause"})])
def test_shipped_passages_record_origin_and_license(name, licenses):
    data = resources.files("epikv").joinpath("data")
    lines = data.joinpath(f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 48 and len({r["id"] for r in rows}) == 48
    assert {r["license"] for r in rows} == licenses
    assert all(r["source"] == name and r["origin"] and r["smollm2_tokens"] >= 1024 for r in rows)
    for path in {r["license_file"] for r in rows} - {None}:
        assert data.joinpath(path).is_file()
    assert len(data.joinpath(f"{name}.jsonl").read_bytes()) < 1_000_000
