"""No silent emptiness (issue #12 item 10): an empty selection is an error, a failed run leaves no
folder for `report` to show forever, and the summary says what was selected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epikv.cli import main
from epikv.eval import cli
from epikv.eval.config import EvalConfig
from epikv.eval.report import find_run_folders
from epikv.eval.runner import plan_run, run_eval
from epikv.eval.tasks import load_task

from .fakes import FakeFactory, FakeGenerator, boxed

GSM = load_task("gsm8k")
GOLD = {e.problem: e.answer for e in GSM}


def right(problem: str) -> Any:
    return boxed(GOLD[problem])


def config(tmp_path: Path, **overrides: Any) -> EvalConfig:
    fields: dict[str, Any] = {"dataset": "gsm8k", "policy": "full", "out": str(tmp_path / "runs"),
                              "progress": False}  # fmt: skip
    return EvalConfig(**{**fields, **overrides})


def test_an_empty_selection_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"--offset 5000 selects no problems: gsm8k has 1319 \(positions 0-1318\)"
    ):
        plan_run(config(tmp_path, offset=5000))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"dataset '.*empty.jsonl' has no problems"):
        plan_run(config(tmp_path, dataset=str(empty)))


def test_the_command_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    assert (
        main(["eval", "--dataset", "gsm8k", "--policy", "full", "--offset", "5000", "--out", str(out)]) == 2
    )
    assert capsys.readouterr().err.startswith("epikv: error: --offset 5000 selects no problems")
    assert not out.exists()


class Broken(FakeGenerator):
    def __call__(self, prompts: Any, sampling: Any) -> Any:
        raise RuntimeError("the model fell over")


def test_a_run_that_fails_before_its_first_record_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    with pytest.raises(RuntimeError, match="fell over"):
        run_eval(config(tmp_path, limit=2), FakeFactory(Broken(right)))
    assert list((tmp_path / "runs").iterdir()) == []  # the folder the user named stays
    # A run killed after a record keeps its folder (it resumes).
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(tmp_path, limit=3), FakeFactory(FakeGenerator(right, fail_after_calls=1)))
    assert len(find_run_folders([tmp_path / "runs"])) == 1


def test_report_ignores_a_run_folder_without_records(tmp_path: Path) -> None:
    folder = tmp_path / "gsm8k" / "h2o" / "K64"  # what a failed run of an older version left
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"dataset": "gsm8k", "policy": "h2o", "budget": 64}))
    (folder / "results.jsonl").write_text("")
    assert find_run_folders([tmp_path]) == []


def test_the_summary_counts_the_selection_and_names_what_lies_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_default_generator_factory", lambda model, **_: lambda *a: FakeGenerator(right))
    argv = ["eval", "--dataset", "gsm8k", "--policy", "full", "--no-progress", "--out", str(tmp_path)]
    assert main([*argv, "--limit", "7"]) == 0
    assert "selected: gsm8k problems 0-6 (7 of 1319) x 1 sample(s); to generate: full Kfull 7" in (
        capsys.readouterr().out
    )
    assert main([*argv, "--limit", "6"]) == 0
    out = capsys.readouterr().out
    assert "to generate: full Kfull 0" in out
    assert "(1 more records in the folder are outside this selection)" in out
    assert "| gsm8k | full | full | 6 | 100.0 [" in out
    summary = json.loads((tmp_path / "gsm8k" / "full" / "Kfull" / "summary.json").read_text())
    assert (summary["n"], summary["n_expected"], summary["n_outside_selection"]) == (6, 6, 1)
    assert summary["selection"] == {
        "dataset_size": 1319, "problems": 6, "positions": [0, 5], "samples": 1, "shard": "0/1",
    }  # fmt: skip
