"""Every command checks where it will write before it works (issue #12 item 4)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import epikv.bench.capacity.study
import epikv.calibrate.pipeline
import epikv.outputs
from epikv.cli import main
from epikv.eval import cli as eval_cli
from epikv.outputs import OutputPathError, check_output_dir, check_output_file

from .eval.test_report import make_run


def test_a_folder_may_exist_or_be_made_and_the_check_leaves_nothing(tmp_path: Path) -> None:
    assert check_output_dir(tmp_path) == tmp_path
    assert check_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert check_output_file(tmp_path / "c" / "x.png", "--png") == tmp_path / "c" / "x.png"
    assert list(tmp_path.iterdir()) == []


def test_a_file_where_a_folder_goes_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputPathError, match=r"--out .*/f is a file, not a folder"):
        check_output_dir(tmp_path / "f")
    with pytest.raises(OutputPathError, match="f is a file, so no folder can be made under it"):
        check_output_dir(tmp_path / "f" / "sub" / "deeper")
    with pytest.raises(OutputPathError, match=r"--png .* is a folder, not a file"):
        check_output_file(tmp_path, "--png")


def refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only folder: the probe write fails (chmod would not stop root, who runs CI)."""

    def read_only(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(epikv.outputs.tempfile, "TemporaryFile", read_only)


def test_an_unwritable_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_writes(monkeypatch)
    with pytest.raises(OutputPathError, match=r"cannot write in .* \(Permission denied\)"):
        check_output_dir(tmp_path / "new")


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load or measurement fails the test: the path check must come first."""

    def forbidden(*args: object, **kwargs: object) -> None:
        """Stands in for the work (the bench parser reads this line as its help)."""
        raise AssertionError("the command worked before checking its output path")

    monkeypatch.setattr(eval_cli, "_default_generator_factory", forbidden)
    monkeypatch.setattr(epikv.bench.capacity.study, "run_capacity", forbidden)
    monkeypatch.setattr(epikv.calibrate.pipeline, "run_calibration", forbidden)


def commands(out: Path, runs: Path) -> list[list[str]]:
    return [
        ["eval", "--dataset", "gsm8k", "--policy", "full", "--limit", "1", "--out", str(out)],
        ["bench", "capacity", "--quick", "--out", str(out)],
        ["calibrate", "--dataset", "gsm8k", "--quick", "--out", str(out)],
        ["report", str(runs), "--plots", str(out)],
    ]


@pytest.mark.parametrize("index", range(4), ids=["eval", "bench", "calibrate", "report"])
@pytest.mark.parametrize("problem", ["file", "read-only"])
def test_every_command_fails_in_one_line_before_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_work: None,
    index: int, problem: str,
) -> None:  # fmt: skip
    runs = tmp_path / "runs"
    make_run(runs, "h2o", 256, [(True, False, 1.0)])
    out = tmp_path / "out"
    if problem == "file":
        out.write_text("")
    else:
        refuse_writes(monkeypatch)
    assert main(commands(out, runs)[index]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("epikv: error: --") and captured.err.count("\n") == 1
    assert captured.out == ""


def test_bench_plot_checks_its_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "plot", str(tmp_path / "missing.json"), "--png", str(tmp_path)]) == 2
    assert "--png" in capsys.readouterr().err
