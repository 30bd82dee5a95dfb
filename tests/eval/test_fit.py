"""Every selected prompt is checked against every (policy, budget) before anything is generated
(issue #12 item 2: `--budget 120` gave 3 results, then status 2, and `streaming` never ran)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epikv.cli import main
from epikv.eval import cli
from epikv.eval.config import EvalConfig
from epikv.eval.fit import UnfitPromptsError
from epikv.eval.records import load_skipped, read_results
from epikv.eval.report import report
from epikv.eval.runner import run_eval
from epikv.eval.tasks import load_task

from .fakes import FakeFactory, FakeGenerator, boxed, fake_spec

GSM = load_task("gsm8k")
GOLD = {e.problem: e.answer for e in GSM}
# With one token per word and EpiKV's protection (prompt + r = K/4), the first ten GSM8K prompts
# need K of 85, 45, 62, 49, 131, 70, 58, 83, 125, 74: at K=80, problems 0, 4, 7 and 8 cannot run.
UNFIT_AT_80 = ["gsm8k-0000", "gsm8k-0004", "gsm8k-0007", "gsm8k-0008"]


def generator(budget: int | None = 80, policy: str = "random", **kwargs: Any) -> FakeGenerator:
    return FakeGenerator(lambda problem: boxed(GOLD[problem]), spec=fake_spec(policy, budget), **kwargs)


def config(tmp_path: Path, **overrides: Any) -> EvalConfig:
    fields: dict[str, Any] = {
        "dataset": "gsm8k", "policy": "random", "budget": 80, "limit": 10, "out": str(tmp_path),
        "progress": False,
    }  # fmt: skip
    return EvalConfig(**{**fields, **overrides})


def test_an_unfit_prompt_stops_the_run_before_anything_is_written(tmp_path: Path) -> None:
    fake = generator()
    with pytest.raises(UnfitPromptsError) as info:
        run_eval(config(tmp_path), FakeFactory(fake))
    message = str(info.value)
    assert "random K80: 4 of 10 problems (gsm8k-0000, gsm8k-0004, gsm8k-0007, …) cannot run" in message
    assert "e.g. gsm8k-0000: budget 80 cannot hold the protected tokens" in message
    assert "the smallest budget that fits all 10 is 131" in message and "--skip-unfit" in message
    assert fake.calls == [] and list(tmp_path.iterdir()) == []


def test_skipped_problems_are_recorded_apart_and_never_graded(tmp_path: Path) -> None:
    fake = generator()
    outcome = run_eval(config(tmp_path), FakeFactory(fake), skip_unfit=True)
    assert outcome.generated == 6 and outcome.skipped == 4
    assert fake.problems_asked == [GSM[i].problem for i in (1, 2, 3, 5, 6, 9)]
    skipped = load_skipped(outcome.folder)
    assert sorted(s.id for s in skipped) == UNFIT_AT_80
    assert all("cannot hold the protected tokens" in s.reason for s in skipped)
    assert len(read_results(outcome.folder / "results.jsonl")) == 6
    summary = json.loads((outcome.folder / "summary.json").read_text())
    assert (summary["n"], summary["n_skipped"], summary["accuracy"]) == (6, 4, 1.0)
    assert "| gsm8k | random | 80 | 6 (+4 skipped) | 100.0 [" in report([tmp_path])
    # A resumed run does not try them again, with or without --skip-unfit.
    again = generator()
    assert run_eval(config(tmp_path), FakeFactory(again)).generated == 0 and again.calls == []


def test_a_prompt_past_the_context_names_the_context(tmp_path: Path) -> None:
    fake = generator(budget=None, policy="full", context_length=60)
    with pytest.raises(UnfitPromptsError, match=r"full Kfull: 4 of 10 .*the prompt has 64 tokens but the "
                       r"model's context is 60 tokens\. Use"):  # fmt: skip
        run_eval(config(tmp_path, policy="full", budget=None), FakeFactory(fake))


class Engine:
    """The engine's factory for `eval_command`: fake generators whose prompts are checked."""

    def __init__(self) -> None:
        self.generators: list[FakeGenerator] = []

    def __call__(self, policy: str, budget: int | None, interval: int | None, params: dict) -> FakeGenerator:
        self.generators.append(generator(budget, policy))
        return self.generators[-1]


def test_eval_checks_every_run_before_the_first_generates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = Engine()
    monkeypatch.setattr(cli, "_default_generator_factory", lambda model, **_: engine)
    argv = ["eval", "--dataset", "gsm8k", "--policy", "streaming", "--policy", "random", "--budget", "200",
            "--budget", "80", "--limit", "10", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[epikv] ")]
    assert len(err) == 1 and err[0].startswith("epikv: error: nothing was generated: random K80: 4 of 10")
    assert "streaming" not in err[0] and "K200" not in err[0]  # those fit
    assert all(g.calls == [] for g in engine.generators) and list(tmp_path.iterdir()) == []

    assert main([*argv, "--skip-unfit"]) == 0
    out = capsys.readouterr().out
    assert "skipping (--skip-unfit): random K80: 4 of 10 problems" in out
    assert "| gsm8k | random | 80 | 6 (+4 skipped) |" in out and "| gsm8k | streaming | 80 | 10 |" in out


def test_the_engines_generator_counts_tokens_as_it_will_send_them(
    monkeypatch: pytest.MonkeyPatch, embedded_tokenizer: Any
) -> None:
    from epikv import generation
    from epikv.engine import prompt_fit
    from epikv.eval.prompts import build_messages
    from epikv.models import tiny_model

    model = tiny_model("llama", identity="tiny-fit", max_position_embeddings=64)
    monkeypatch.setitem(generation._MODELS, ("tiny-fit", "float32"), (model, embedded_tokenizer))
    made = generation.make_generator("tiny-fit", "random", 48)
    short, long = build_messages("What is 2 + 2?"), build_messages("word " * 80)
    fits = made.fit([short, long])  # type: ignore[attr-defined]
    tokens = len(generation.encode_prompt_ids(embedded_tokenizer, [short])[0])
    assert fits[0] == prompt_fit(made.spec, 64, tokens)  # type: ignore[attr-defined]
    assert fits[0].problem is not None and "smallest budget that holds them is" in fits[0].problem
    assert fits[1].problem is not None and "but the model's context is 64 tokens" in fits[1].problem


def test_a_ray_shard_checks_its_prompts_and_can_skip(tmp_path: Path) -> None:
    from epikv.eval.ray_runner import run_shard

    def engine(policy: str, budget: int | None, interval: int | None, params: dict) -> FakeGenerator:
        return generator(budget, policy)

    with pytest.raises(UnfitPromptsError, match="random K80: 4 of 10"):
        run_shard(config(tmp_path), engine)
    outcome = run_shard(config(tmp_path), engine, skip_unfit=True)
    assert (outcome.generated, outcome.skipped) == (6, 4)
