"""``epikv eval --rank-every N`` (issue 56): rho reaches the spec every run builds, on epikv's engine
and in what the vLLM plugin is handed; it is saved with the run (only when set) and a resume under
another rho is refused, as any other result-affecting change is."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from epikv import generation
from epikv.cli import main
from epikv.eval.config import EvalConfig, differing_fields, saved_form
from epikv.eval.generator import generator_factory
from epikv.eval.prompts import build_messages
from epikv.eval.records import load_run_results
from epikv.eval.vllm_generator import plugin_config
from epikv.integration import build_spec
from epikv.models import tiny_model

PROBLEMS = {"a": "Ann has 3 apples and buys 2 more. How many?", "b": "What is 7 times 6?"}
# lagkv compacts every 128 steps by its own rule: with rho it runs at tau = 1 and holds K + 1 at most.
ARGS = ["--policy", "lagkv", "--budget", "48", "--max-new-tokens", "64", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_rho(embedded_tokenizer: Any) -> Any:
    return tiny_model("llama", identity="tiny-rho", vocab_size=len(embedded_tokenizer))


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "two.jsonl"
    rows = [{"id": key, "problem": problem, "answer": "5"} for key, problem in PROBLEMS.items()]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def engine_model(monkeypatch: pytest.MonkeyPatch, tiny_rho: Any, embedded_tokenizer: Any) -> str:
    """The tiny model as what `--model tiny-rho` loads (the engine's model cache, filled)."""
    monkeypatch.setitem(generation._MODELS, ("tiny-rho", "float32"), (tiny_rho, embedded_tokenizer))
    return "tiny-rho"


def eval_argv(model: str, dataset: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--model", model, "--dataset", str(dataset), "--out", str(out), *ARGS, *extra]


def test_an_eval_with_rank_every_generates_what_the_engine_does_with_that_spec(
    engine_model: str, dataset: Path, tmp_path: Path, tiny_rho: Any, embedded_tokenizer: Any, capsys
) -> None:
    out = tmp_path / "runs"
    assert main(eval_argv(engine_model, dataset, out, "--rank-every", "8")) == 0
    folder = out / "two" / "lagkv" / "K48"
    records = {r.id: r for r in load_run_results(folder)}
    spec = build_spec(tiny_rho, "lagkv", 48, rank_every=8)
    sampling = generation.SamplingConfig(max_new_tokens=64)
    for key, problem in PROBLEMS.items():
        [alone] = generation.generate(
            tiny_rho, embedded_tokenizer, [build_messages(problem)], spec, None, sampling
        )
        assert records[key].token_ids == alone.token_ids
        assert records[key].peak_cache_tokens == 48 + 1  # without rho lagkv holds up to K + 128
    saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert (saved["rank_every"], saved["interval"]) == (8, None)
    assert json.loads((folder / "spec.json").read_text(encoding="utf-8"))["rank_every"] == 8
    assert "rank_every=8" in capsys.readouterr().err  # the spec's line says it


def test_a_resume_under_another_rank_every_is_refused(
    engine_model: str, dataset: Path, tmp_path: Path, capsys
):
    out = tmp_path / "runs"
    assert main(eval_argv(engine_model, dataset, out, "--rank-every", "8", "--limit", "1")) == 0
    capsys.readouterr()
    for other in (["--rank-every", "16"], []):
        assert main(eval_argv(engine_model, dataset, out, *other)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "rank_every: saved 8, now" in err
    assert len(load_run_results(out / "two" / "lagkv" / "K48")) == 1  # nothing more was generated


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rank-every", "0"], "rank_every must be a positive number of decode steps, got '0'"),
        (["--rank-every", "often"], "got 'often'"),
        (["--rank-every", "8", "--interval", "4"], "needs interval 1, got interval=4 with rank_every=8"),
        (["--rank-every", "8", "--policy-param", "interval=2"], "got interval=2"),
    ],
)
def test_a_bad_rank_every_is_one_line_before_any_model_loads(capsys, dataset, tmp_path, extra, message):
    assert main(eval_argv("/nonexistent/model", dataset, tmp_path / "runs", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "nonexistent" not in err
    assert not (tmp_path / "runs").exists()


def test_the_config_checks_rank_every_and_saves_it_only_when_set() -> None:
    with pytest.raises(ValueError, match="got -3"):
        EvalConfig("gsm8k", "lagkv", 48, rank_every=-3)
    with pytest.raises(ValueError, match="interval=4 with rank_every=8"):
        EvalConfig("gsm8k", "lagkv", 48, interval=4, rank_every=8)
    assert EvalConfig("gsm8k", "lagkv", 48, rank_every="8").rank_every == 8  # type: ignore[arg-type]
    plain, ranked = EvalConfig("gsm8k", "lagkv", 48), EvalConfig("gsm8k", "lagkv", 48, rank_every=8)
    assert "rank_every" not in saved_form(plain) and saved_form(ranked)["rank_every"] == 8
    old = {k: v for k, v in saved_form(plain).items() if k not in ("dtype", "engine")}  # before the fields
    assert differing_fields(old, saved_form(plain)) == []
    assert differing_fields(old, saved_form(ranked)) == ["rank_every"]


def test_equal_peak_with_rank_every_is_k_plus_one_and_full_takes_no_rho(dataset, tmp_path) -> None:
    from epikv.eval.cli import build_parser, configs_from_args

    argv = [
        "eval",
        "--dataset",
        str(dataset),
        "--out",
        str(tmp_path),
        "--policy",
        "lagkv",
        "--policy",
        "full",
    ]
    configs = configs_from_args(build_parser().parse_args([*argv, "--peak", "193", "--rank-every", "32"]))
    assert [(c.policy, c.budget, c.rank_every) for c in configs] == [("lagkv", 192, 32), ("full", None, None)]


def test_every_engine_is_asked_with_rho_and_the_plugin_is_handed_it() -> None:
    asked: list[dict[str, Any]] = []
    engine = lambda *args, **kwargs: asked.append(kwargs)  # noqa: E731
    generator_factory(engine, EvalConfig("gsm8k", "lagkv", 48, rank_every=8))("lagkv", 48)
    generator_factory(engine, EvalConfig("gsm8k", "lagkv", 48))("lagkv", 48)
    assert asked == [{"rank_every": 8}, {}]
    assert plugin_config("lagkv", 48, None, {}, 8) == {"policy": "lagkv", "budget": 48, "rank_every": 8}
    assert plugin_config("lagkv", 48, None, {}) == {"policy": "lagkv", "budget": 48}


def test_the_vllm_worker_is_started_with_rho_in_the_plugins_config() -> None:
    """The caller's side of ``--engine vllm``: the spec the plugin resolves from the settings it is
    handed equals epikv's own, and rho travels in the start message, which the worker hands to
    ``epikv.vllm.engine_kwargs`` (the runs themselves: tests/vllm)."""
    from epikv.eval.generator import engine_for_model
    from epikv.eval.vllm_generator import VllmGenerator
    from epikv.vllm.config import EpiKVSettings

    assert "rank_every" in {f.name for f in dataclasses.fields(EpiKVSettings)}
    mine = VllmGenerator(None, "keydiff", 100, None, {}, dtype="float32", max_new_tokens=64, rank_every=8)
    theirs = engine_for_model(None)("keydiff", 100, None, {}, rank_every=8)
    assert mine.spec.config() == theirs.spec.config() and mine.spec.rank_every == 8
    assert mine.start_msg["rank_every"] == 8 and "options" not in mine.start_msg
    plain = VllmGenerator(None, "keydiff", 100, None, {}, dtype="float32", max_new_tokens=64)
    assert "rank_every" not in plain.start_msg and plain.spec.rank_every is None
