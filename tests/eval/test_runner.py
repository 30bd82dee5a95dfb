from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from epikv.eval.config import ConfigMismatchError, EvalConfig
from epikv.eval.records import read_results
from epikv.eval.runner import RunFolderBusyError, WorkItem, batches, plan_work, run_eval
from epikv.eval.tasks import load_task

from .fakes import FakeFactory, FakeGenerator, FakeResult, boxed

GSM = load_task("gsm8k")
GOLD = {e.problem: e.answer for e in GSM}


def right_answers(problem: str) -> FakeResult:
    return boxed(GOLD[problem])


def config(tmp_path: Path, **overrides: object) -> EvalConfig:
    fields: dict[str, object] = {
        "dataset": "gsm8k", "policy": "h2o", "budget": 512, "limit": 10,
        "out": str(tmp_path), "progress": False,
    }  # fmt: skip
    fields.update(overrides)
    return EvalConfig(**fields)  # type: ignore[arg-type]


def folder(tmp_path: Path) -> Path:
    return tmp_path / "gsm8k" / "h2o" / "K512"


def test_run_writes_results_config_and_summary(tmp_path: Path) -> None:
    factory = FakeFactory(FakeGenerator(right_answers))
    outcome = run_eval(config(tmp_path, batch_size=4), factory)
    assert outcome.folder == folder(tmp_path)
    assert factory.requested == [("h2o", 512)]
    records = read_results(folder(tmp_path) / "results.jsonl")
    assert [r.id for r in records] == [f"gsm8k-{i:04d}" for i in range(10)]
    assert all(r.correct for r in records)
    assert [len(problems) for problems, _ in factory.generator.calls] == [4, 4, 2]
    assert records[0].seconds == pytest.approx(0.25) and records[0].call_seconds == 1.0
    saved = json.loads((folder(tmp_path) / "config.json").read_text())
    assert saved["max_new_tokens"] == 8192 and "out" not in saved and "shard" not in saved
    summary = json.loads((folder(tmp_path) / "summary.json").read_text())
    assert summary["n"] == 10 and summary["accuracy"] == 1.0 and summary["n_expected"] == 10


def test_paper_protocol_reaches_the_generator(tmp_path: Path) -> None:
    seen: list[list[dict[str, str]]] = []

    class Spy(FakeGenerator):
        def __call__(self, prompts: list[list[dict[str, str]]], sampling: object) -> list[FakeResult]:
            seen.extend(prompts)
            return list(super().__call__(prompts, sampling))

    generator = Spy(lambda problem: boxed("0"))
    run_eval(config(tmp_path, limit=1, dataset="aime2024"), lambda policy, budget: generator)
    assert seen[0][0] == {
        "role": "system",
        "content": "Please reason step by step, and put your final answer within \\boxed{}.",
    }
    assert seen[0][1]["role"] == "user" and seen[0][1]["content"].startswith("Every morning Aya")
    sampling = generator.calls[0][1]
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_p) == (16384, 0.0, 1.0)


def test_resume_after_a_kill_loses_nothing_and_duplicates_nothing(tmp_path: Path) -> None:
    # A first process finished 4 examples and was killed while writing the 5th.
    first = FakeGenerator(right_answers)
    run_eval(config(tmp_path, limit=4), FakeFactory(first))
    results = folder(tmp_path) / "results.jsonl"
    torn = boxed("1").text[:10]
    with results.open("a", encoding="utf-8") as handle:
        handle.write('{"id": "gsm8k-0004", "sample": 0, "correct": tr' + torn)
    second = FakeGenerator(right_answers)
    run_eval(config(tmp_path), FakeFactory(second))
    asked = [GSM[i].problem for i in range(4, 10)]
    assert second.problems_asked == asked
    ids = [r.id for r in read_results(results)]
    assert ids == [f"gsm8k-{i:04d}" for i in range(10)]
    # Running again has nothing left to do and never builds a generator.
    third = FakeFactory(FakeGenerator(right_answers))
    outcome = run_eval(config(tmp_path), third)
    assert outcome.generated == 0 and third.requested == []


def test_generator_crash_keeps_finished_batches(tmp_path: Path) -> None:
    crashing = FakeGenerator(right_answers, fail_after_calls=2)
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(tmp_path, batch_size=3), FakeFactory(crashing))
    assert len(read_results(folder(tmp_path) / "results.jsonl")) == 6
    resumed = FakeGenerator(right_answers)
    run_eval(config(tmp_path, batch_size=3), FakeFactory(resumed))
    assert resumed.problems_asked == [GSM[i].problem for i in range(6, 10)]


def test_changed_config_is_an_error_naming_the_fields(tmp_path: Path) -> None:
    run_eval(config(tmp_path, limit=2), FakeFactory(FakeGenerator(right_answers)))
    with pytest.raises(ConfigMismatchError, match="interval: saved None, now 64") as info:
        run_eval(
            config(tmp_path, limit=2, interval=64, max_new_tokens=100),
            FakeFactory(FakeGenerator(right_answers)),
        )
    assert "interval" in str(info.value) and "max_new_tokens" in str(info.value)
    assert "batch_size" not in str(info.value)
    # Batch size, limit and shard do not change results: resuming with them changed is fine.
    run_eval(config(tmp_path, limit=3, batch_size=2), FakeFactory(FakeGenerator(right_answers)))


def test_shards_split_deterministically_and_merge(tmp_path: Path) -> None:
    generators = []
    for index in range(3):
        generator = FakeGenerator(right_answers)
        run_eval(config(tmp_path, shard=f"{index}/3"), FakeFactory(generator))
        generators.append(generator)
    asked = [set(g.problems_asked) for g in generators]
    assert asked[0] == {GSM[i].problem for i in (0, 3, 6, 9)}
    assert asked[1] == {GSM[i].problem for i in (1, 4, 7)}
    assert not (asked[0] & asked[1]) and not (asked[1] & asked[2])
    files = sorted(p.name for p in folder(tmp_path).glob("results*.jsonl"))
    assert files == [f"results.shard-{i}-of-3.jsonl" for i in range(3)]
    summary = json.loads((folder(tmp_path) / "summary.json").read_text())
    assert summary["n"] == 10


def test_plan_work_is_sample_major_and_skips_done() -> None:
    task = GSM.slice(limit=3)
    work = plan_work(task, 2, (0, 1), done={("gsm8k-0001", 0)})
    assert [(w.example.id, w.sample) for w in work] == [
        ("gsm8k-0000", 0), ("gsm8k-0002", 0), ("gsm8k-0000", 1), ("gsm8k-0001", 1), ("gsm8k-0002", 1),
    ]  # fmt: skip


def test_batches_never_mix_samples() -> None:
    items = [WorkItem(GSM[i], s) for s in range(2) for i in range(3)]
    groups = [[(w.example.index, w.sample) for w in g] for g in batches(items, 2)]
    assert groups == [[(0, 0), (1, 0)], [(2, 0)], [(0, 1), (1, 1)], [(2, 1)]]


def test_sampling_runs_each_sample_under_its_own_seed(tmp_path: Path) -> None:
    generator = FakeGenerator(right_answers)
    run_eval(
        config(tmp_path, limit=2, batch_size=2, temperature=0.6, top_p=0.95, n_samples=3, seed=7),
        FakeFactory(generator),
    )
    seeds = [sampling.seed for _, sampling in generator.calls]
    assert seeds == [7, 8, 9]
    summary = json.loads((folder(tmp_path) / "summary.json").read_text())
    assert summary["n"] == 6 and summary["n_problems"] == 2


def test_cap_hit_and_loop_are_recorded(tmp_path: Path) -> None:
    def looping(problem: str) -> FakeResult:
        return FakeResult(
            text="wait wait wait", token_ids=list(range(50)) + [1, 2] * 200, finish_reason="length"
        )

    run_eval(config(tmp_path, limit=1), FakeFactory(FakeGenerator(looping)))
    (only,) = read_results(folder(tmp_path) / "results.jsonl")
    assert only.cap_hit and only.loop and only.loop_onset == 50 and only.loop_period == 2
    assert not only.correct and only.extracted is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"budget": 0}, "budget"),
        ({"n_samples": 4}, "temperature"),
        ({"shard": "3/3"}, "3/3"),
        ({"top_p": 0.0}, "top_p"),
        ({"batch_size": 0}, "batch_size"),
        ({"policy": "a/b"}, "policy"),
    ],
)
def test_config_validation_names_the_bad_value(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **overrides)


def test_results_from_any_shard_count_are_skipped(tmp_path: Path) -> None:
    run_eval(config(tmp_path, shard="0/2"), FakeFactory(FakeGenerator(right_answers)))
    rest = FakeGenerator(right_answers)
    run_eval(dataclasses.replace(config(tmp_path), shard=None), FakeFactory(rest))
    assert rest.problems_asked == [GSM[i].problem for i in (1, 3, 5, 7, 9)]


def test_second_writer_of_the_same_shard_fails_fast(tmp_path: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    run_eval(config(tmp_path, limit=1), FakeFactory(FakeGenerator(right_answers)))
    with (folder(tmp_path) / "results.jsonl").open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(RunFolderBusyError, match="another process is already writing"):
            run_eval(config(tmp_path, limit=2), FakeFactory(FakeGenerator(right_answers)))


def test_resolved_policy_is_pinned_across_resumes(tmp_path: Path) -> None:
    generator = FakeGenerator(right_answers)
    generator.resolved_policy = {"name": "h2o", "band_a": 9}  # type: ignore[attr-defined]
    run_eval(config(tmp_path, limit=2), FakeFactory(generator))
    assert json.loads((folder(tmp_path) / "policy.json").read_text()) == {"name": "h2o", "band_a": 9}
    generator.resolved_policy = {"name": "h2o", "band_a": 29}  # type: ignore[attr-defined]
    with pytest.raises(ConfigMismatchError, match="band_a"):
        run_eval(config(tmp_path, limit=4), FakeFactory(generator))


def test_a_generation_cut_at_the_cap_is_graded_as_cut(tmp_path: Path) -> None:
    def cut_on_the_gold(problem: str) -> FakeResult:  # ends on the gold number, at the cap
        return FakeResult(text=f"so far 3 x 8 = {GOLD[problem]}", token_ids=[1, 2, 3], finish_reason="length")

    run_eval(config(tmp_path, limit=1), FakeFactory(FakeGenerator(cut_on_the_gold)))
    (only,) = read_results(folder(tmp_path) / "results.jsonl")
    assert only.cap_hit and only.extracted is None and not only.correct
