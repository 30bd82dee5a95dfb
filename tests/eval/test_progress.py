from __future__ import annotations

import json
from pathlib import Path

from epikv.eval.progress import ResultsWatcher


def line(example_id: str, sample: int = 0) -> str:
    return json.dumps({"id": example_id, "sample": sample, "text": "x\ny"}) + "\n"


def test_each_poll_returns_only_the_lines_completed_since_the_last(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    watcher = ResultsWatcher([run, run])
    assert watcher.poll() == {run: set()}  # no file yet
    shard = run / "results.shard-0-of-2.jsonl"
    shard.write_text(line("a") + line("b", 1))
    assert watcher.poll() == {run: {("a", 0), ("b", 1)}}
    assert watcher.poll() == {run: set()}
    with shard.open("a") as handle:
        handle.write(line("c") + line("d")[:10])  # a line still being written
    (run / "results.jsonl").write_text(line("e"))
    (run / "summary.json").write_text(line("not-a-result"))
    assert watcher.poll() == {run: {("c", 0), ("e", 0)}}
    with shard.open("a") as handle:
        handle.write(line("d")[10:])
    assert watcher.poll() == {run: {("d", 0)}}


def test_a_truncated_file_and_a_bad_line_are_survived(tmp_path: Path) -> None:
    shard = tmp_path / "results.jsonl"
    shard.write_text(line("a") + "{torn\n")
    watcher = ResultsWatcher([tmp_path])
    assert watcher.poll() == {tmp_path: {("a", 0)}}
    shard.write_text(line("a"))  # the writer's repair_tail cut the bad line
    with shard.open("a") as handle:
        handle.write(line("b"))
    assert watcher.poll() == {tmp_path: {("a", 0), ("b", 0)}}  # read again from the start
    assert watcher.poll() == {tmp_path: set()}
