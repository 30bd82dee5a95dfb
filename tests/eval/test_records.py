from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from epikv.eval.records import (
    load_run_results,
    merge_results,
    read_results,
    repair_tail,
    results_filename,
)

from .test_metrics import record


def _write(path: Path, lines: list[str], tail: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + tail, encoding="utf-8")


def test_results_filenames() -> None:
    assert results_filename(0, 1) == "results.jsonl"
    assert results_filename(2, 4) == "results.shard-2-of-4.jsonl"


def test_torn_last_line_is_ignored_and_truncated(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    good = [record("a", True).to_json(), record("b", False).to_json()]
    torn = record("c", True).to_json()[:37]
    _write(path, good, tail=torn)
    assert [r.id for r in read_results(path)] == ["a", "b"]
    assert repair_tail(path) == len(torn)
    assert path.read_text(encoding="utf-8") == "".join(line + "\n" for line in good)
    assert repair_tail(path) == 0


def test_unparseable_complete_last_line_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    _write(path, [record("a", True).to_json(), "\x00\x00\x00"])
    assert repair_tail(path) == 4
    assert [r.id for r in read_results(path)] == ["a"]


def test_corrupt_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    _write(path, [record("a", True).to_json(), "{oops", record("b", True).to_json()])
    with pytest.raises(ValueError, match=r"results.jsonl:2"):
        read_results(path)


def test_merge_dedupes_and_rejects_conflicts() -> None:
    a = record("a", True)
    retimed = dataclasses.replace(a, seconds=99.0)
    merged = merge_results([[a, record("b", False)], [retimed]])
    assert sorted(r.key for r in merged) == [("a", 0), ("b", 0)]
    with pytest.raises(ValueError, match="'a' sample 0 appears twice with different correct"):
        merge_results([[a], [dataclasses.replace(a, correct=False)]])
    other_sample = dataclasses.replace(a, sample=1, correct=False)
    assert len(merge_results([[a, other_sample]])) == 2


def test_load_run_results_merges_shard_files(tmp_path: Path) -> None:
    _write(tmp_path / "results.shard-0-of-2.jsonl", [record("a", True).to_json()])
    _write(tmp_path / "results.shard-1-of-2.jsonl", [record("b", True).to_json()], tail='{"id": "c"')
    _write(tmp_path / "results.jsonl", [record("a", True).to_json()])
    assert sorted(r.id for r in load_run_results(tmp_path)) == ["a", "b"]
