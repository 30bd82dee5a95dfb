from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from epikv.eval import cli
from epikv.eval.cli import add_eval_parser, add_report_parser, parse_budget_arg
from epikv.eval.tasks import load_task

from .fakes import FakeGenerator, FakeResult, boxed
from .test_report import make_run

GSM3 = load_task("gsm8k").slice(limit=3)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="epikv")
    subparsers = top.add_subparsers(dest="command", required=True)
    add_eval_parser(subparsers)
    add_report_parser(subparsers)
    return top


class RecordingEngine:
    """Stands in for the engine's make_generator with the model bound: answers 2 of 3 problems right."""

    def __init__(self) -> None:
        self.built: list[tuple[str, int | None, int | None, dict[str, Any]]] = []
        self.model_names: list[str | None] = []

    def factory_for(self, model_name: str | None, **_: object) -> RecordingEngine:
        self.model_names.append(model_name)
        return self

    def __call__(self, policy: str, budget: int | None, interval: int | None, params: dict[str, Any]) -> Any:
        self.built.append((policy, budget, interval, params))
        gold = {e.problem: e.answer for e in GSM3}

        def respond(problem: str) -> FakeResult:
            return boxed("-1") if problem == GSM3[2].problem else boxed(gold[problem])

        return FakeGenerator(respond)


def test_parse_budget() -> None:
    assert parse_budget_arg("512") == 512
    for bad in ("-3", "0", "full", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got .*{bad}.*use the policy 'full'"):
            parse_budget_arg(bad)


def test_full_needs_no_budget_and_evicting_policies_need_one() -> None:
    args = parser().parse_args(["eval", "--dataset", "gsm8k", "--policy", "full", "--out", "o"])
    (config,) = cli.configs_from_args(args)
    assert config.budget is None and config.budget_label == "Kfull"
    args = parser().parse_args(["eval", "--dataset", "gsm8k", "--policy", "epikv", "--out", "o"])
    with pytest.raises(ValueError, match="'epikv' evicts and needs --budget"):
        cli.configs_from_args(args)


def test_policy_params_are_typed_and_checked() -> None:
    argv = ["eval", "--dataset", "gsm8k", "--policy", "streaming", "--budget", "64", "--out", "o"]
    args = parser().parse_args(
        [*argv, "--policy-param", "protect_prompt=False", "--policy-param", "n_sink=2"]
    )
    (config,) = cli.configs_from_args(args)
    assert config.policy_params == {"protect_prompt": False, "n_sink": 2}
    for bad, message in (("protect_prompt=maybe", "not a boolean"), ("n_sink=abc", "not an integer"),
                         ("windw=3", "unknown parameter 'windw'")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            cli.configs_from_args(parser().parse_args([*argv, "--policy-param", bad]))


def test_eval_end_to_end_on_three_gsm8k_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = RecordingEngine()
    monkeypatch.setattr(cli, "_default_generator_factory", engine.factory_for)
    argv = [
        "eval", "--model", "tiny", "--dataset", "gsm8k", "--policy", "h2o", "--policy", "epikv",
        "--policy", "full", "--budget", "256", "--budget", "128", "--limit", "3", "--batch-size", "2",
        "--interval", "16", "--policy-param", "recent=32", "--no-progress", "--out", str(tmp_path),
    ]  # fmt: skip
    args = parser().parse_args(argv)
    assert args.func(args) == 0
    assert engine.model_names == ["tiny"]
    assert engine.built == [
        ("h2o", 256, 16, {"recent": 32}),
        ("h2o", 128, 16, {"recent": 32}),
        ("epikv", 256, 16, {"recent": 32}),
        ("epikv", 128, 16, {"recent": 32}),
        ("full", None, 16, {"recent": 32}),  # full runs once, whatever the budgets
    ]
    for policy, label in (("h2o", "K256"), ("h2o", "K128"), ("epikv", "K256"), ("full", "Kfull")):
        summary = json.loads((tmp_path / "gsm8k" / policy / label / "summary.json").read_text())
        assert summary["n"] == 3 and summary["accuracy"] == pytest.approx(2 / 3)
    assert not (tmp_path / "gsm8k" / "full" / "K256").exists()
    out = capsys.readouterr().out
    assert "| gsm8k | h2o | 256 | 3 | 66.7 [" in out and "| gsm8k | full | full | 3 | 66.7 [" in out

    args = parser().parse_args(["report", str(tmp_path), "--plots", str(tmp_path / "plots")])
    assert args.func(args) == 0
    assert "| gsm8k | epikv | 256 | 3 | 66.7 [" in capsys.readouterr().out
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3


def test_eval_says_and_records_which_bands_each_run_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from epikv.policies.base import ModelInfo
    from epikv.spec import CacheSpec

    monkeypatch.setenv("EPIKV_CACHE_DIR", str(tmp_path / "cache"))  # no user profile: the shipped one
    smol = ModelInfo("smollm2-135m", 30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)
    engine = RecordingEngine()

    def with_spec(policy: str, budget: int | None, interval: int | None, params: dict[str, Any]) -> Any:
        generator = engine(policy, budget, interval, params)
        generator.spec = CacheSpec.build(smol, policy, budget, interval=interval)  # as make_generator's
        return generator

    argv = ["eval", "--dataset", "gsm8k", "--policy", "epikv-flat", "--policy", "streaming",
            "--budget", "256", "--limit", "3", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert cli.eval_command(parser().parse_args(argv), engine=with_spec) == 0
    said = capsys.readouterr()
    assert "\nthreads " in said.out  # the --threads auto choice, beside the selection
    lines = [line for line in said.err.splitlines() if line.startswith("[epikv]")]
    assert lines == [
        "[epikv] policy=epikv-flat budget=256 interval=1 bands A=7 B=26 (shipped profile smollm2-135m.json)",
        "[epikv] policy=streaming budget=256 interval=1",
    ]
    saved = json.loads((tmp_path / "gsm8k" / "epikv-flat" / "K256" / "spec.json").read_text())
    assert saved["bands"] == {"band_a": 7, "band_b": 26, "origin": "shipped profile smollm2-135m.json"}
    assert saved["describe"] == lines[0].removeprefix("[epikv] ")
    assert json.loads((tmp_path / "gsm8k" / "streaming" / "K256" / "spec.json").read_text())["bands"] is None


def test_report_prints_the_table_before_plotting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path, "h2o", 256, [(True, False, 1.0), (False, False, 1.0)])

    def broken(*args: object) -> None:
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(cli, "draw_all", broken)
    args = parser().parse_args(["report", str(tmp_path), "--plots", str(tmp_path / "plots")])
    with pytest.raises(RuntimeError, match="drawing failed"):
        args.func(args)
    assert "| math500 | h2o | 256 | 2 | 50.0 [" in capsys.readouterr().out


def test_eval_rejects_bad_arguments_before_loading_anything(tmp_path: Path) -> None:
    engine = RecordingEngine()
    args = parser().parse_args(
        [
            "eval",
            "--dataset",
            "gsm8k",
            "--policy",
            "h2o",
            "--budget",
            "64",
            "--shard",
            "2/2",
            "--out",
            str(tmp_path),
        ]
    )
    with pytest.raises(ValueError, match="shard"):
        cli.eval_command(args, engine=engine)
    assert engine.built == []


def test_sampling_options_reach_the_config() -> None:
    args = parser().parse_args(
        ["eval", "--dataset", "aime2024", "--policy", "streaming", "--budget", "1024", "--temperature", "0.6",
         "--top-p", "0.95", "--samples", "4", "--shard", "1/4", "--out", "o"]
    )  # fmt: skip
    (config,) = cli.configs_from_args(args)
    assert (config.temperature, config.top_p, config.n_samples, config.shard) == (0.6, 0.95, 4, "1/4")
    assert config.budget == 1024 and config.max_new_tokens is None


def test_a_concurrent_eval_into_a_locked_folder_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fcntl = pytest.importorskip("fcntl")
    from epikv.cli import main

    monkeypatch.setattr(cli, "_default_generator_factory", RecordingEngine().factory_for)
    argv = ["eval", "--dataset", "gsm8k", "--policy", "full", "--no-progress", "--out", str(tmp_path)]
    assert main([*argv, "--limit", "1"]) == 0
    with (tmp_path / "gsm8k" / "full" / "Kfull" / "results.jsonl").open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another process is writing this run
        assert main([*argv, "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epikv: error: another process is already writing") and err.count("\n") == 1


def test_ctrl_c_during_eval_keeps_the_results_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from epikv.cli import main

    def engine(policy: str, budget: int | None, interval: int | None, params: dict[str, Any]) -> Any:
        gold = {e.problem: e.answer for e in GSM3}
        return FakeGenerator(lambda problem: boxed(gold[problem]), fail_after_calls=2)  # Ctrl-C

    monkeypatch.setattr(cli, "_default_generator_factory", lambda model, **_: engine)
    argv = ["eval", "--dataset", "gsm8k", "--policy", "full", "--policy", "streaming", "--budget", "64",
            "--limit", "3", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err == (
        f"epikv: interrupted: 2 results are kept under {tmp_path} (0 of 2 runs finished); "
        "run the same command again to resume"
    )


def test_equal_peak_memory_gives_each_policy_its_own_budget() -> None:
    base = ["eval", "--dataset", "gsm8k", "--out", "runs", "--peak", "384"]
    args = parser().parse_args([*base, "--policy", "streaming", "--policy", "epikv", "--policy", "full"])
    found = [(c.policy, c.budget) for c in cli.configs_from_args(args)]
    assert found == [("streaming", 383), ("epikv", 256), ("full", None)]  # tau 1 and 128; full: none
    args = parser().parse_args([*base, "--policy", "epikv", "--budget", "256", "--interval", "32"])
    assert [c.budget for c in cli.configs_from_args(args)] == [256, 352]  # --budget and --peak both run
    args = parser().parse_args([*base, "--policy", "snapkv", "--policy-param", "interval=64"])
    assert [c.budget for c in cli.configs_from_args(args)] == [320]
    args = parser().parse_args(
        ["eval", "--dataset", "gsm8k", "--out", "r", "--policy", "epikv", "--peak", "100"]
    )
    with pytest.raises(ValueError, match="peak 100 is not above epikv's interval tau = 128"):
        cli.configs_from_args(args)
