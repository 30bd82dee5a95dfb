"""Grading the loop study's stored generations again (issue 58): a hand-made document and its parts."""

from __future__ import annotations

import json
from pathlib import Path

from epikv.bench.loops.regrade import regrade_placed
from epikv.bench.loops.study import LoopsConfig, _batches, _problem_records, dataset_parts
from epikv.bench.loops.summary import markdown, summarize_loops
from epikv.bench.shared import documents
from epikv.bench.shared.model_loading import load_bench_tokenizer
from epikv.cli import main

CONFIG = LoopsConfig(
    model="random:tiny-llama",
    datasets=("gsm8k",),
    problems=(2,),
    offsets=(0,),
    policies=("full", "h2o"),
    peaks=(128,),
    sweep_policies=(),
    sweep_budgets=(),
    references=("full",),
    batch_size=2,
)
PLAN = [
    {"label": "full", "kind": "peak", "target": 128, "budget": None, "cell": "full"},
    {"label": "h2o", "kind": "peak", "target": 128, "budget": 127, "cell": "h2o@127"},
]
CUT = "cut at the length cap with no final-answer marker: its last number is not credited"


def _ids(text: str) -> list[int]:
    """Token ids the random models' byte tokenizer decodes to ``text`` (printable ASCII; ids < 2
    are its special tokens, so every id is shifted by its 95-symbol cycle)."""
    return [ord(c) - 32 + 95 for c in text]


def _record(prompt: int, text: str, finish: str, correct: bool, extracted: str | None) -> dict:
    return {
        "prompt_tokens": prompt, "token_ids": _ids(text), "finish_reason": finish, "correct": correct,
        "extracted": extracted, "first_evicted_index": None, "evictions": 0, "compactions": 0,
        "peak_cache_tokens": 40, "mean_cache_tokens": 30.0, "seconds": 0.1,
    }  # fmt: skip


def _fabricate(tmp_path: Path) -> tuple[Path, list[str]]:
    """A two-problem document and its parts as the grader before issue 58 graded them: `full` on
    problem 0 ran to the cap and was credited its last number, which is the gold."""
    config = LoopsConfig(**{**CONFIG.__dict__, "parts_dir": str(tmp_path / "parts")})
    ((dataset, b, batch),) = _batches(config, load_bench_tokenizer(config.model))
    (n0, n1), (g0, g1) = [len(p.prompt) for p in batch], [p.example.answer for p in batch]
    cells = {
        "full": [
            _record(n0, f"so 3 x 8 = {g0}", "length", True, g0),
            _record(n1, "so \\boxed{0}.", "eos", False, "0"),
        ],
        "h2o@127": [  # a complete box before the cap, and the last number of a generation that ended
            _record(n0, f"so \\boxed{{{g0}}} and 7", "length", True, g0),
            _record(n1, f"it is {g1}", "eos", True, g1),
        ],
    }  # fmt: skip
    parts = dataset_parts(config.parts_dir, dataset)
    for cell, records in cells.items():
        parts.put(b, cell, "fingerprint", records, 1.0)
    problems = _problem_records(batch, cells, config.loop_config(), frozenset())
    summary = summarize_loops(problems, PLAN, config.references)
    results = {"model": config.model, "plan": PLAN, "problems": problems, "summary": summary}
    path = documents.write_result(
        documents.make_document("loops", config, results, "cpu", []), tmp_path / "run"
    )
    (tmp_path / "run" / "tables.md").write_text(markdown(summary) + "\n")
    return path, [p.example.id for p in batch]


def _files(tmp_path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tmp_path)): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}


def test_regrade_moves_the_verdict_cut_at_the_cap_and_keeps_every_other_byte(tmp_path, capsys):
    path, ids = _fabricate(tmp_path)
    before = _files(tmp_path)
    assert main(["bench", "regrade", str(path)]) == 0
    assert (
        "4 generations graded again, 1 part records and 2 facts updated, 1 verdicts moved"
        in capsys.readouterr().out
    )
    after = _files(tmp_path)
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert changed == ["parts/gsm8k/b00/full.json", "run/loops.json", "run/regrade.json", "run/tables.md"]
    old, new = (json.loads(x[changed[0]]) for x in (before, after))
    assert new["results"][0] == old["results"][0] | {"correct": False, "extracted": None}
    assert new == old | {"results": [new["results"][0], old["results"][1]]}  # nothing else in the part
    doc, was = json.loads(after["run/loops.json"]), json.loads(before["run/loops.json"])
    p0 = doc["results"]["problems"][0]["cells"]
    assert (p0["full"]["correct"], p0["full"]["extracted"], p0["h2o@127"]["full_correct"]) == (
        False,
        None,
        False,
    )
    for fact, old_fact in ((p0["full"], was["results"]["problems"][0]["cells"]["full"]),
                           (p0["h2o@127"], was["results"]["problems"][0]["cells"]["h2o@127"])):  # fmt: skip
        assert {k: v for k, v in fact.items() if k not in ("correct", "extracted", "full_correct")} == {
            k: v for k, v in old_fact.items() if k not in ("correct", "extracted", "full_correct")
        }
    assert doc["results"]["problems"][1] == was["results"]["problems"][1]
    assert {k: doc[k] for k in documents.TOP_LEVEL_KEYS if k != "results"} == {
        k: was[k] for k in documents.TOP_LEVEL_KEYS if k != "results"
    }
    rows = doc["results"]["summary"]["rows"]["gsm8k"]
    assert (rows["full"]["correct"]["successes"], rows["h2o@127"]["correct"]["successes"]) == (0, 2)
    was_rows = was["results"]["summary"]["rows"]["gsm8k"]
    assert (was_rows["full"]["correct"]["successes"], was_rows["h2o@127"]["gained_vs_full"]) == (1, 1)
    assert rows["h2o@127"]["gained_vs_full"] == 2  # problem 0 too, now that full is not credited it
    assert after["run/tables.md"].decode() == markdown(doc["results"]["summary"]) + "\n"
    listed = json.loads(after["run/regrade.json"])
    assert (listed["records"], listed["updated"], listed["moved_per_cell"]) == (4, 2, {"full": 1})
    gold = old["results"][0]["extracted"]
    assert listed["moved"] == [{
        "run": str(tmp_path / "run"), "cell": "full", "problem": f"gsm8k/{ids[0]}", "old": True, "new": False,
        "rule": CUT, "extracted": [gold, None], "finish_reason": "length",
    }]  # fmt: skip
    assert main(["bench", "regrade", str(path)]) == 0  # a second run finds nothing to change
    assert "0 part records and 0 facts updated, 0 verdicts moved" in capsys.readouterr().out
    assert _files(tmp_path) == after


def test_records_that_carry_their_place_are_graded_again_in_place(tmp_path):
    config = LoopsConfig(**{**CONFIG.__dict__, "parts_dir": None})
    tokenizer = load_bench_tokenizer(config.model)
    ((dataset, b, batch),) = _batches(config, tokenizer)
    problems = {(dataset, b, i): p for i, p in enumerate(batch)}
    gold = batch[1].example.answer
    placed = {"dataset": dataset, "id": batch[1].example.id, "batch": b, "index": 1}
    records = [
        {"dataset": dataset, "id": batch[0].example.id, "batch": b, "index": 0, "skipped": "too long"},
        {**placed, **_record(len(batch[1].prompt), f"then {gold}", "length", True, gold)},
        {**placed, **_record(len(batch[1].prompt), f"then {gold}", "length", True, gold)},
    ]
    del records[2]["correct"], records[2]["extracted"]  # a record that stores no verdict
    unverdicted = json.dumps(records[2])
    row = regrade_placed(records, problems, tokenizer, "out", "epikv@192")
    assert (row["records"], row["updated"]) == (1, 1)
    assert [(m["problem"], m["old"], m["new"], m["rule"]) for m in row["moved"]] == [
        (f"gsm8k/{batch[1].example.id}", True, False, CUT)
    ]
    assert (records[1]["correct"], records[1]["extracted"]) == (False, None)
    assert json.dumps(records[2]) == unverdicted
    assert records[0] == {
        "dataset": dataset,
        "id": batch[0].example.id,
        "batch": b,
        "index": 0,
        "skipped": "too long",
    }
