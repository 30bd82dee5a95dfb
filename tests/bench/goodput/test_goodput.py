"""``epikv bench goodput`` without vLLM: the default pool rule, a cell's row from a fake generator
(grading and the per-minute arithmetic by hand), resume, the figure from the JSON alone, the flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from epikv.bench.cli import build_config
from epikv.bench.goodput import study
from epikv.bench.goodput.study import Cell, GoodputConfig, default_pool_tokens, run_goodput
from epikv.bench.shared import documents
from epikv.cli import build_parser, main
from epikv.engine import Completion
from epikv.eval.tasks import load_task

LENGTHS = [100, 130, 90, 120]  # the fake's prompt lengths: the longest, 130, sizes the default pool
RIGHT = {0, 2}  # problems the fake answers right


class FakeSpec:
    def __init__(self, cell: Cell) -> None:
        self.interval = 1 if cell.budget is not None else 0
        self.cell = cell

    def record(self) -> dict[str, Any]:
        return {
            "describe": f"policy={self.cell.policy} budget={self.cell.budget}",
            "budget": self.cell.budget,
        }


class FakeGenerator:
    """Answers problems RIGHT with the gold answer boxed and the others with 0; the scheduler stats
    are given; peaks of an evicting cell are 64 + problem index."""

    made: ClassVar[list[FakeGenerator]] = []

    def __init__(self, config: GoodputConfig, cell: Cell, max_new_tokens: int) -> None:
        self.cell, self.max_new_tokens, self.pool, self.closed = cell, max_new_tokens, None, False
        self.spec = FakeSpec(cell)
        self.stats: dict[str, Any] = {}
        self.answers = [e.answer for e in load_task("gsm8k").slice(0, len(LENGTHS))]
        FakeGenerator.made.append(self)

    def prompt_ids(self, prompts: list[Any]) -> list[list[int]]:
        return [[7] * n for n in LENGTHS[: len(prompts)]]

    def size_pool(self, pool_tokens: int) -> None:
        self.pool = pool_tokens

    def fit(self, prompts: list[Any]) -> list[Any]:
        from epikv.engine.admission import PromptFit

        return [PromptFit(n) for n in LENGTHS[: len(prompts)]]

    def __call__(self, prompts: list[Any], sampling: Any) -> list[Completion]:
        assert sampling.max_new_tokens == self.max_new_tokens and sampling.temperature == 0.0
        self.stats = {"wall_s": 30.0, "max_running": 3, "mean_running": 2.5, "preemptions": 2, "steps": 50}
        out = []
        for n, gold in enumerate(self.answers):
            text = f"So the answer is \\boxed{{{gold if n in RIGHT else 0}}}."
            tokens = 10 * (n + 1)  # 10, 20, 30, 40 generated
            out.append(Completion(
                request_id=n, token_ids=[5] * tokens, finish_reason="eos" if n else "length",
                prompt_tokens=LENGTHS[n], peak_cache_tokens=64 + n, final_cache_tokens=0, evictions=0,
                compactions=0, first_evicted_index=None, prefill_seconds=0.0, seconds=30.0, text=text,
            ))  # fmt: skip
        return out

    def close(self) -> None:
        self.closed = True


def _config(tmp_path: Path, **given: Any) -> GoodputConfig:
    fields = {"problems": (4,), "max_new_tokens": 128, "policies": ("full", "keydiff"), "budgets": (96,)}
    return GoodputConfig(**{**fields, "parts_dir": str(tmp_path / "parts"), **given})


def test_the_default_pool_is_eight_full_requests_at_the_cap_in_whole_blocks():
    assert default_pool_tokens(130, 128) == 8 * 288  # 258 tokens round up to 9 blocks of 32
    assert default_pool_tokens(100, 28) == 8 * 128  # already whole blocks: not rounded further
    assert default_pool_tokens(1, 8192, requests=2) == 2 * 8224
    with pytest.raises(ValueError, match="whole blocks of 32"):
        GoodputConfig(pool_tokens=1000)


def test_a_cells_row_is_graded_and_timed_as_computed_by_hand(tmp_path):
    FakeGenerator.made.clear()
    document = run_goodput(_config(tmp_path), make_generator=FakeGenerator)
    full, keydiff = document["results"]["rows"]
    assert [g.pool for g in FakeGenerator.made] == [8 * 288, 8 * 288]  # one pool for every cell
    assert all(g.closed for g in FakeGenerator.made)
    assert full == {
        "dataset": "gsm8k", "policy": "full", "budget": None, "interval": None, "rank_every": None,
        "pool_tokens": 2304, "problems": 4, "correct": 2, "accuracy": 0.5, "wall_s": 30.0,
        "correct_per_min": 4.0, "max_running": 3, "mean_running": 2.5, "preemptions": 2,
        # full: prompt + generated = 110, 150, 120, 160
        "mean_cache_per_request": 135.0, "max_cache_per_request": 160,
        "generated_tokens": 100, "tokens_per_s": 100 / 30.0, "cap_hits": 1, "errors": 0, "steps": 50,
        "max_new_tokens": 128, "vllm": None,
    }  # fmt: skip
    assert keydiff["policy"] == "keydiff" and keydiff["budget"] == 96 and keydiff["interval"] == 1
    assert (keydiff["mean_cache_per_request"], keydiff["max_cache_per_request"]) == (65.5, 67)  # peaks 64..67
    assert document["kind"] == "goodput" and document["config"]["pool_tokens"] is None
    assert document["machine"]["cpu"]["model"] is not None and "flags" in document["machine"]["cpu"]
    assert [s["describe"] for s in document["config"]["cache_specs"]] == [
        "policy=full budget=None",
        "policy=keydiff budget=96",
    ]


def test_a_finished_cell_is_not_run_again(tmp_path):
    first = run_goodput(_config(tmp_path), make_generator=FakeGenerator)

    def refuse(*args: Any) -> Any:
        raise AssertionError("a finished cell ran again")

    again = run_goodput(_config(tmp_path), make_generator=refuse)
    assert again["results"] == first["results"]
    assert again["config"]["cache_specs"] == first["config"]["cache_specs"]
    FakeGenerator.made.clear()  # another pool is another result: both cells run again
    changed = run_goodput(_config(tmp_path, pool_tokens=4096), make_generator=FakeGenerator)
    assert len(FakeGenerator.made) == 2 and {r["pool_tokens"] for r in changed["results"]["rows"]} == {4096}


def test_the_figure_is_drawn_from_the_json_alone(tmp_path):
    row = {"dataset": "gsm8k", "policy": "full", "budget": None, "rank_every": None, "pool_tokens": 2304,
           "accuracy": 0.5, "correct_per_min": 4.0}  # fmt: skip
    rows = [row, {**row, "policy": "keydiff", "budget": 96, "accuracy": 0.25, "correct_per_min": 6.0}]
    document = documents.make_document("goodput", {"model": None}, {"rows": rows})
    path = documents.write_result(document, tmp_path)
    png = study.plot_goodput(path)
    assert png == tmp_path / "goodput.png" and png.stat().st_size > 1000
    png.unlink()
    assert main(["bench", "plot", str(path)]) == 0 and png.is_file()


def test_the_command_takes_the_kinds_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "goodput", "--help"])
    out = capsys.readouterr().out
    for flag in ("--pool-tokens", "--rank-every", "--policies", "--budgets", "--interval", "--problems",
                 "--datasets", "--max-new-tokens", "--model", "--dtype", "--eager"):  # fmt: skip
        assert flag in out
    args = build_parser().parse_args([
        "bench", "goodput", "--out", "o", "--policies", "full,keydiff", "--budgets", "96,192",
        "--rank-every", "32", "--pool-tokens", "4096", "--problems", "8", "--eager",
    ])  # fmt: skip
    config = build_config("goodput", args)
    assert (config.policies, config.budgets, config.rank_every) == (("full", "keydiff"), (96, 192), 32)
    assert (config.pool_tokens, config.problems, config.eager) == (4096, (8,), True)
    assert config.parts_dir == str(Path("o") / "goodput-parts")
    names = [c.name for c in study.cells(config)]
    assert names == ["full", "keydiff@96 rho=32", "keydiff@192 rho=32"]
    assert json.loads(json.dumps(documents.config_dict(config)))["eager"] is True
