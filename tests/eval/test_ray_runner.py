"""`epikv eval --ray`: shards as Ray tasks on a local 2-CPU cluster started here (no model: a
scripted engine that Ray pickles by reference, since workers share this checkout's working folder)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from epikv.cli import main as epikv_main
from epikv.engine import PromptFit
from epikv.eval import cli
from epikv.eval.config import EvalConfig, saved_form
from epikv.eval.ray_runner import RayOptions, shard_configs
from epikv.eval.records import read_results
from epikv.eval.report import format_table, load_runs
from epikv.eval.tasks import load_task
from tests.helpers.ray_cluster import local_cluster, ray_test

from .fakes import FakeResult, boxed

GSM = load_task("gsm8k").slice(limit=6)
IDS = {example.problem: example.id for example in GSM}
GOLD = {example.problem: example.answer for example in GSM}


@dataclass(frozen=True)
class ScriptedEngine:
    """An EngineFactory for Ray tasks: right answers except for the last problem, every problem asked
    logged to `log` (one line each, from any worker). With `die_after`, the first worker to reach
    that many generate calls exits the process at once (once per `marker` file)."""

    log: str
    die_after: int | None = None
    marker: str = ""

    def __call__(self, policy: str, budget: int | None, interval: int | None, params: dict[str, Any]) -> Any:
        return _Generator(self)


class _Generator:
    spec = resolved_policy = None  # the generator protocol's: nothing resolved, every prompt fits

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine, self.calls = engine, 0

    def fit(self, prompts: list[list[dict[str, str]]]) -> list[PromptFit]:
        return [PromptFit(0) for _ in prompts]

    def __call__(self, prompts: list[list[dict[str, str]]], sampling: Any) -> Sequence[FakeResult]:
        if self.calls == self.engine.die_after and _first_to_die(self.engine.marker):
            os._exit(1)  # a worker lost mid-run: no exception, no clean-up
        self.calls += 1
        problems = [messages[-1]["content"] for messages in prompts]
        with open(self.engine.log, "a", encoding="utf-8") as handle:
            handle.write("".join(f"{IDS[problem]}\n" for problem in problems))
        return [boxed("-1") if problem == GSM[5].problem else boxed(GOLD[problem]) for problem in problems]


def _first_to_die(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def eval_args(out: Path, *extra: str) -> argparse.Namespace:
    argv = ["eval", "--dataset", "gsm8k", "--limit", "6", "--policy", "full", "--policy", "streaming"]
    argv += ["--budget", "64", "--no-progress", "--out", str(out), *extra]
    return cli.build_parser().parse_args(argv)


def records_by_key(out: Path) -> dict[tuple[str, str, tuple[str, int]], dict[str, Any]]:
    """Every record under `out`, keyed by (policy, budget folder, (id, sample)); duplicates fail."""
    found: dict[tuple[str, str, tuple[str, int]], dict[str, Any]] = {}
    for path in sorted(out.rglob("results*.jsonl")):
        for record in read_results(path):
            key = (path.parent.parent.name, path.parent.name, record.key)
            assert key not in found, f"duplicate record {key}"
            found[key] = dataclasses.asdict(record)
    return found


def asked(log: Path) -> Counter[str]:
    return Counter(log.read_text(encoding="utf-8").split()) if log.exists() else Counter()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with local_cluster(seconds=180) as ray:  # about 25 s when nothing hangs
        yield ray


@ray_test
def test_ray_and_local_shards_write_the_records_of_a_local_run(cluster: Any, tmp_path: Path) -> None:
    local_log, ray_log = tmp_path / "local.log", tmp_path / "ray.log"
    assert cli.eval_command(eval_args(tmp_path / "local"), ScriptedEngine(str(local_log))) == 0
    # Shard 0 of 3 runs here, then --ray runs all three: shard 0 finds nothing left to do.
    mixed = tmp_path / "mixed"
    assert cli.eval_command(eval_args(mixed, "--shard", "0/3"), ScriptedEngine(str(ray_log))) == 0
    assert cli.eval_command(eval_args(mixed, "--ray", "--shards", "3"), ScriptedEngine(str(ray_log))) == 0

    assert records_by_key(mixed) == records_by_key(tmp_path / "local")
    assert len(records_by_key(mixed)) == 2 * 6
    assert asked(ray_log) == asked(local_log) and set(asked(ray_log).values()) == {2}  # once per run
    folder = mixed / "gsm8k" / "streaming" / "K64"
    assert sorted(p.name for p in folder.glob("results*")) == [
        f"results.shard-{i}-of-3.jsonl" for i in range(3)
    ]
    assert (folder / "config.json").read_text() == (
        tmp_path / "local/gsm8k/streaming/K64/config.json"
    ).read_text()
    assert format_table(load_runs([mixed])) == format_table(load_runs([tmp_path / "local"]))
    assert "| 6 | 83.3" in format_table(load_runs([mixed]))  # n = 6, 5 of 6 right


@ray_test
def test_a_task_whose_worker_dies_is_rerun_and_nothing_is_lost_or_duplicated(
    cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, marker = tmp_path / "asked.log", tmp_path / "died"
    engine = ScriptedEngine(str(log), die_after=2, marker=str(marker))
    args = eval_args(tmp_path / "out", "--ray", "--shards", "2")
    assert cli.eval_command(args, engine) == 0
    assert marker.exists()  # one worker did die after writing two records
    records = records_by_key(tmp_path / "out")  # fails on a duplicate
    assert {key[2][0] for key in records} == set(IDS.values()) and len(records) == 2 * 6
    assert set(asked(log).values()) == {2}  # the re-run asked only for what was missing
    assert "generated 6" in capsys.readouterr().out


@ray_test
def test_a_failing_task_is_reported_and_the_others_finish(
    cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Shard 1's folder holds another configuration: its tasks fail; shard 0's complete.
    out = tmp_path / "out"
    clash = EvalConfig("gsm8k", "full", out=str(out), limit=6, max_new_tokens=7, progress=False)
    (out / "gsm8k/full/Kfull").mkdir(parents=True)
    (out / "gsm8k/full/Kfull/config.json").write_text(json.dumps(saved_form(clash)))
    args = eval_args(out, "--ray", "--shards", "2")
    assert cli.eval_command(args, ScriptedEngine(str(tmp_path / "log"))) == 1
    err = capsys.readouterr().err
    assert err.count("epikv eval: failed: epikv-eval gsm8k full Kfull") == 2 and "ConfigMismatchError" in err
    assert "run the same command again" in err
    assert len(read_results(out / "gsm8k/streaming/K64/results.shard-0-of-2.jsonl")) == 3


def test_shards_split_each_run_and_a_named_shard_stays_one() -> None:
    runs = [EvalConfig("gsm8k", "full"), EvalConfig("gsm8k", "streaming", 64, shard="1/4")]
    shards = shard_configs(runs, 2)
    assert [(c.policy, c.shard) for c in shards] == [("full", "0/2"), ("full", "1/2"), ("streaming", "1/4")]
    assert not any(c.progress for c in shards)
    assert all(c.out == str(Path("runs").resolve()) for c in shards)  # workers may start elsewhere
    assert [c.shard for c in shard_configs(runs[:1], 1)] == [None]  # one task writes results.jsonl
    with pytest.raises(ValueError, match="shards must be >= 1"):
        RayOptions(shards=0)


def test_ray_flags_without_ray_and_ray_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="--shards, --gpus-per-task only apply with --ray"):
        cli.eval_command(eval_args(tmp_path, "--shards", "2", "--gpus-per-task", "1"))
    with pytest.raises(SystemExit, match="not both"):
        cli.eval_command(eval_args(tmp_path, "--ray", "--shard", "0/2", "--shards", "2"))
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    argv = ["eval", "--dataset", "gsm8k", "--policy", "full", "--limit", "2", "--out", str(tmp_path), "--ray"]
    assert epikv_main(argv) == 2
    err = capsys.readouterr().err
    assert err == "epikv: error: Ray is not installed; install it with: pip install 'epikv[ray]'\n"
