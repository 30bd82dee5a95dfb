"""The accuracy study's design rules and statistics, on hand-made run folders (no model runs)."""

from __future__ import annotations

import dataclasses
import math
from itertools import pairwise

import pytest

from epikv.bench.accuracy.design import Arm, Study, budgets_by_rule, paired_sample_size
from epikv.bench.accuracy.report import markdown
from epikv.bench.accuracy.summary import holm, repeats, summarize
from epikv.eval.records import ExampleResult, SkippedExample, append_result
from epikv.eval.runner import prepare_folder
from epikv.eval.tasks import load_task


def test_the_budget_rule_takes_fractions_of_the_median_in_whole_blocks():
    assert budgets_by_rule([100, 400, 200, 300]) == (128, 192)  # median 250: 125 -> 128, 187.5 -> 192
    assert budgets_by_rule([388]) == (192, 288)
    assert budgets_by_rule([10, 20, 30]) == (32, 32)  # never below one block
    with pytest.raises(ValueError, match="no full-cache traces"):
        budgets_by_rule([])


def test_the_sample_size_rule_is_connors_formula():
    za, zb = 1.959963984540054, 0.8416212335729143
    expected = (za * math.sqrt(0.15) + zb * math.sqrt(0.15 - 0.0025)) ** 2 / 0.0025
    assert paired_sample_size(0.15, 0.05) == math.ceil(expected) == 469
    assert paired_sample_size(0.10, 0.05) < 469 < paired_sample_size(0.15, 0.04)
    with pytest.raises(ValueError, match="discordance"):
        paired_sample_size(0.002, 0.05)


def test_holm_adjusts_step_down_and_keeps_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == [1.0, 1.0]  # step-down: never below an earlier step
    assert holm([0.02, 0.3]) == pytest.approx([0.04, 0.3])


def test_every_policy_runs_once_at_the_main_k_and_attention_rows_run_on_epikvs_engine():
    cells = Study().cells()
    main = [c for c in cells if c.arm == "gsm8k" and c.budget == 192 and not c.tag]
    assert sorted(c.policy for c in main) == sorted(
        ["epikv", "epikv-seg", "epikv-flat", "epikv-lag", "streaming", "h2o", "tova", "snapkv", "rkv",
         "keydiff", "random"]
    )  # fmt: skip
    assert {c.policy for c in main if c.engine == "epikv"} == {"h2o", "tova", "snapkv", "rkv"}
    assert all(c.engine == "vllm-compiled" for c in main if c.policy not in ("h2o", "tova", "snapkv", "rkv"))
    assert [c.tag for c in cells if c.tag] == ["eager", "engine", "batch16"]
    peak = {c.policy: c.budget for c in cells if c.arm == "gsm8k" and c.budget == 319}
    assert peak == {"streaming": 319, "keydiff": 319, "h2o": 319, "epikv-flat": 319}  # 319 + 1 = 192 + 128
    assert len({c.name for c in cells}) == len(cells)


def _record(example_id: str, correct: bool, tokens: list[int], cap: bool = False) -> ExampleResult:
    return ExampleResult(
        id=example_id, sample=0, correct=correct, extracted=None, gold="1", tokens_generated=len(tokens),
        prompt_tokens=10, finish_reason="length" if cap else "eos", cap_hit=cap, loop=False,
        loop_onset=None, loop_period=None, seconds=1.0, call_seconds=4.0, batch_size=4,
        peak_cache_tokens=10 + len(tokens), final_cache_tokens=None, evictions=1, text="", token_ids=tokens,
    )  # fmt: skip


def _write(study, cell, out, verdicts, skipped=(), looping=(), tau=128):
    config = cell.config(str(out), study.model, study.dtype, progress=False)
    from epikv.eval.plan import plan_run

    plan = plan_run(config)
    prepare_folder(plan.folder, plan.config)
    ids = [e.id for e in plan.task]
    with (plan.folder / "results.jsonl").open("a") as handle:
        for i, correct in zip(ids, verdicts, strict=False):
            if i in skipped:
                continue
            tokens = [7, 8] * 80 if i in looping else list(range(20))
            append_result(handle, _record(i, correct, tokens, cap=i in looping))
    with (plan.folder / "skipped.jsonl").open("a") as handle:
        for i in skipped:
            append_result(handle, SkippedExample(i, 0, "too long", 99))
    if cell.budget is not None:
        (plan.folder / "spec.json").write_text(f'{{"interval": {tau}}}')
    return ids


def test_the_summary_pairs_on_common_problems_and_names_what_it_excludes(tmp_path):
    arm = Arm("gsm8k", "gsm8k:shuffle=0", 6, 64, (100,), ("full", "epikv", "h2o"))
    study = dataclasses.replace(Study(arms=(arm,)), noise_problems=6, budget_problems=6)
    cells = {c.name: c for c in study.cells()}
    ids = [e.id for e in load_task("gsm8k:shuffle=0").slice(0, 6)]
    _write(study, cells["gsm8k/full@full"], tmp_path, [1, 1, 1, 1, 0, 0])
    _write(
        study, cells["gsm8k/epikv@K100"], tmp_path, [1, 0, 1, 1, 0, 1], skipped=(ids[2],), looping=(ids[1],)
    )
    _write(study, cells["gsm8k/h2o@K100"], tmp_path, [0, 0, 0, 1, 0, 0], looping=(ids[0], ids[1]), tau=1)
    _write(study, cells["gsm8k/full@full [eager]"], tmp_path, [1, 1, 1, 0, 0, 1])
    result = summarize(study, str(tmp_path), frozenset())
    level = result["arms"]["gsm8k"]["levels"]["100"]
    assert level["excluded"] == [ids[2]] and level["n"] == 5  # skipped by epikv: out for h2o and full too
    tests = {t["a"]: t for t in level["vs_full"]["tests"]}
    assert (tests["gsm8k/epikv@K100"]["a_only"], tests["gsm8k/epikv@K100"]["b_only"]) == (1, 1)
    assert (tests["gsm8k/h2o@K100"]["a_only"], tests["gsm8k/h2o@K100"]["b_only"]) == (0, 2)
    assert level["lost"]["gsm8k/h2o@K100"] == {
        "lost": 2, "gained": 0, "loop": 2, "near_loop": 2, "cap_hit": 2, "loop_or_cap": 2
    }  # fmt: skip
    assert level["lost"]["gsm8k/epikv@K100"]["lost"] == 1 and level["lost"]["gsm8k/epikv@K100"]["loop"] == 1
    assert level["accuracy"]["gsm8k/full@full"]["k"] == 3  # ids 0, 1, 3 of the five
    assert result["cells"]["gsm8k/h2o@K100"]["peak_budget"] == 101
    assert result["cells"]["gsm8k/epikv@K100"]["loop"]["k"] == 1
    assert result["arms"]["gsm8k"]["equal_peak"] == {}  # one cell per peak: nothing to pair
    assert "whole" not in level  # every cell has every problem (run or skipped): one reading
    noise = result["noise"]["eager"]
    assert (noise["n"], noise["changed"], noise["identical_tokens"]) == (6, 2, 6)
    assert result["noise"]["engine"]["n"] == 0
    text = markdown(result)
    assert (
        "excluded for all" in text and ids[2] in text and "| gsm8k/h2o@K100 | 2 | 0 | 2 | 2 | 2 | 2 |" in text
    )


def test_a_repeat_elsewhere_is_compared_cell_by_cell_on_the_problems_it_ran(tmp_path):
    arm = Arm("gsm8k", "gsm8k:shuffle=0", 6, 64, (100,), ("full", "epikv"))
    study = dataclasses.replace(Study(arms=(arm,)), noise_problems=6, budget_problems=6)
    cells = {c.name: c for c in study.cells()}
    _write(study, cells["gsm8k/full@full"], tmp_path / "main", [1, 1, 1, 1, 0, 0])
    _write(study, cells["gsm8k/epikv@K100"], tmp_path / "main", [1, 0, 1, 1, 0, 1])
    _write(study, cells["gsm8k/full@full"], tmp_path / "again", [1, 0, 1, 1])
    found = repeats(study, str(tmp_path / "main"), str(tmp_path / "again"), frozenset())
    assert list(found) == ["gsm8k/full@full"]  # epikv was not run again: nothing to compare
    row = found["gsm8k/full@full"]
    assert (row["n"], row["changed"], row["identical_tokens"]) == (4, 1, 4)  # the first 4 of 6 ran
    assert (row["test"]["a_only"], row["test"]["b_only"]) == (0, 1)


def test_a_level_with_partial_cells_is_read_again_on_the_cells_with_every_problem(tmp_path):
    arm = Arm("gsm8k", "gsm8k:shuffle=0", 6, 64, (100,), ("full", "epikv", "h2o", "streaming"))
    study = dataclasses.replace(Study(arms=(arm,)), noise_problems=6, budget_problems=6)
    cells = {c.name: c for c in study.cells()}
    ids = [e.id for e in load_task("gsm8k:shuffle=0").slice(0, 6)]
    _write(study, cells["gsm8k/full@full"], tmp_path, [1, 1, 1, 1, 1, 1])
    _write(study, cells["gsm8k/epikv@K100"], tmp_path, [1, 1, 1, 0, 0, 0], skipped=(ids[5],))
    _write(study, cells["gsm8k/h2o@K100"], tmp_path, [0, 1, 1, 1, 0, 0], tau=1)
    _write(study, cells["gsm8k/streaming@K100"], tmp_path, [1, 0, 0], tau=1)  # 3 of 6 so far
    result = summarize(study, str(tmp_path), frozenset())
    level = result["arms"]["gsm8k"]["levels"]["100"]
    assert level["n"] == 3  # the partial cell's first three
    whole = level["whole"]
    assert whole["cells"] == ["gsm8k/epikv@K100", "gsm8k/h2o@K100"] and whole["n"] == 5
    assert whole["excluded"] == [ids[5]]  # skipped by epikv: out for h2o too
    assert whole["accuracy"]["gsm8k/h2o@K100"]["k"] == 3 and whole["accuracy"]["gsm8k/epikv@K100"]["k"] == 3
    assert "only the cells with every problem" in markdown(result)


def test_a_cell_runs_whole_batches_only(tmp_path):
    from epikv.bench.accuracy.cells import run_cell

    study = Study()
    cell = study.find("gsm8k/full@full")
    with pytest.raises(ValueError, match=r"--limit 100: a cell runs whole batches of 64 .* multiple of 64"):
        run_cell(study, cell, str(tmp_path), limit=100)
    with pytest.raises(ValueError, match=r"no cell 'gsm8k/full@K1'"):
        study.find("gsm8k/full@K1")


def test_status_counts_what_a_folder_holds_and_estimates_from_measured_speed(tmp_path):
    from epikv.bench.accuracy.cells import cell_status, estimate_minutes

    arm = Arm("gsm8k", "gsm8k:shuffle=0", 6, 64, (100,), ("full", "epikv"))
    study = dataclasses.replace(Study(arms=(arm,)), noise_problems=6, budget_problems=6)
    cells = {c.name: c for c in study.cells()}
    _write(study, cells["gsm8k/full@full"], tmp_path, [1, 1, 0, 0])  # 4 of 6, 20 tokens in 1 s each
    full = cell_status(study, cells["gsm8k/full@full"], str(tmp_path))
    assert (full["done"], full["owed"], full["tokens_per_s"], full["mean_tokens"]) == (4, 2, 20.0, 20.0)
    other = cell_status(study, cells["gsm8k/epikv@K100"], str(tmp_path))
    assert (other["done"], other["owed"]) == (0, 6)
    # 6 problems x 20 tokens (full's mean) at 20 tok/s (the engine's measured speed) = 6 s
    assert estimate_minutes(other, [full, other]) == pytest.approx(0.1)
    assert estimate_minutes(full, [full, other]) == pytest.approx(round(2 * 20 / 20 / 60, 1))


def test_a_cell_with_only_skips_so_far_is_a_row_of_dashes():
    from epikv.bench.accuracy.report import cells_table

    row = {"engine": "epikv", "tau": None, "done": 0, "of": 128, "skipped": 1, "correct": None,
           "cap_hit": None, "loop": None, "near_loop": None, "evicted": None, "mean_tokens": None,
           "mean_peak_cache": None, "tokens_per_s": None}  # fmt: skip
    line = cells_table({"gsm8k/epikv@K192 [engine]": row})[-1]
    assert line.startswith("| gsm8k/epikv@K192 [engine] | epikv | – | 0 / 128 | 1 |")
    assert line.endswith("| – | – | – |")


def test_the_headline_pairs_use_every_problem_both_cells_ran_not_the_levels_common_set(tmp_path):
    arm = Arm("gsm8k", "gsm8k:shuffle=0", 6, 64, (100,), ("full", "epikv", "h2o", "tova"),
              peak=228, peak_policies=("h2o",))  # fmt: skip
    study = dataclasses.replace(Study(arms=(arm,)), noise_problems=6, budget_problems=6)
    segq = "gsm8k/epikv@K100"
    against = [b for a, b in study.headline(arm) if a == segq]
    assert against == ["gsm8k/full@full", "gsm8k/h2o@K100", "gsm8k/h2o@K227"]
    assert len(study.headline(arm)) == 3
    cells = {c.name: c for c in study.cells()}
    ids = [e.id for e in load_task("gsm8k:shuffle=0").slice(0, 6)]
    _write(study, cells["gsm8k/full@full"], tmp_path, [1, 1, 1, 1, 0, 0])
    _write(study, cells["gsm8k/epikv@K100"], tmp_path, [1, 0, 1, 1, 0, 1], skipped=(ids[2],))
    _write(study, cells["gsm8k/h2o@K100"], tmp_path, [0, 0, 0, 0, 0, 0], looping=(ids[0],), tau=1)
    _write(study, cells["gsm8k/tova@K100"], tmp_path, [1, 1], tau=1)  # only the first two so far
    result = summarize(study, str(tmp_path), frozenset())
    assert result["arms"]["gsm8k"]["levels"]["100"]["n"] == 2  # the level waits for tova
    block = result["arms"]["gsm8k"]["headline"]
    assert block["family"].startswith("2 headline comparisons")  # h2o@K227 has not run: no pair
    vs_full, vs_h2o = block["tests"]
    assert (vs_full["n"], vs_full["a_only"], vs_full["b_only"], vs_full["excluded"]) == (5, 1, 1, [ids[2]])
    assert (vs_h2o["n"], vs_h2o["a_only"], vs_h2o["b_only"]) == (5, 3, 0)  # epikv right on ids 0, 3, 5
    assert vs_h2o["p"] == pytest.approx(0.25)  # exact McNemar, 3 against 0: 2 * 0.5**3
    assert vs_h2o["p_holm"] == pytest.approx(min(1.0, 2 * 0.25)) and vs_full["p_holm"] == 1.0
    assert vs_h2o["accuracy"]["gsm8k/epikv@K100"]["k"] == 3 and vs_h2o["accuracy"]["gsm8k/h2o@K100"]["k"] == 0
    assert block["lost"]["gsm8k/h2o@K100"] == {
        "n": 6, "lost": 4, "gained": 0, "loop": 1, "near_loop": 1, "cap_hit": 1, "loop_or_cap": 1
    }  # fmt: skip
    assert block["lost"]["gsm8k/epikv@K100"]["n"] == 5 and block["lost"]["gsm8k/epikv@K100"]["lost"] == 1
    text = markdown(result)
    assert "| gsm8k/epikv@K100 | gsm8k/h2o@K100 | 5 | 60.0" in text
    assert "| gsm8k/h2o@K100 | 6 | 4 | 0 | 1 |" in text


def test_every_policy_in_the_figure_has_its_own_colour_and_neighbours_differ_in_marker_too():
    from epikv.bench.accuracy.report import policy_styles

    policies = sorted({c.policy for c in Study().cells() if c.policy != "full"})
    assert len(policies) == 11  # more than a 10-colour cycle holds: the figure once drew two alike
    styles = policy_styles([*policies, *policies[:3]])  # one entry per cell: repeats change nothing
    assert sorted(styles) == policies
    assert len({colour for colour, _ in styles.values()}) == len(policies)
    markers = [styles[p][1] for p in policies]
    assert all(a != b for a, b in pairwise(markers))


def test_a_bf16_study_is_refused_where_bf16_is_emulated_unless_asked(tmp_path, monkeypatch):
    from epikv.bench.accuracy import cells

    study, reached = Study(), []

    def no_generation(config, make, skip_unfit):  # the guard comes before any engine starts
        reached.append(config.dtype)
        raise RuntimeError("generation reached")

    monkeypatch.setattr(cells, "run_eval", no_generation)
    cell = study.find("gsm8k/full@full")
    monkeypatch.setattr(cells, "bf16_matrix_units", lambda device: None)
    with pytest.raises(ValueError, match=r"no bf16 matrix units .* pass --emulated-bf16 to run here anyway"):
        cells.run_cell(study, cell, str(tmp_path), progress=False)
    assert reached == []
    with pytest.raises(RuntimeError, match="generation reached"):
        cells.run_cell(study, cell, str(tmp_path), progress=False, emulated_bf16=True)
    monkeypatch.setattr(cells, "bf16_matrix_units", lambda device: "amx_bf16")
    with pytest.raises(RuntimeError, match="generation reached"):
        cells.run_cell(study, cell, str(tmp_path), progress=False)
    fp32 = dataclasses.replace(study, dtype="float32")
    monkeypatch.setattr(cells, "bf16_matrix_units", lambda device: None)
    with pytest.raises(RuntimeError, match="generation reached"):
        cells.run_cell(fp32, cell, str(tmp_path), progress=False)
    assert reached == ["bfloat16", "bfloat16", "float32"]
