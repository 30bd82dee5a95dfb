"""The loop study's stored generations graded again by the grader's current rules (issue 58).

A loop document (``loops.json``) keeps per problem and cell the facts of one generation, its
verdict among them; the token ids stay in the parts store. Every generation a document uses is
decoded with the study's tokenizer and graded by its task as the study grades it
(:func:`epikv.bench.loops.runs.graded_tokens`: the cut from its finish reason). A part record
whose verdict or extracted answer changed is rewritten, nothing else in the part; the document's
facts follow (``correct``, ``extracted``, and ``full_correct`` from `full`'s), and its summary,
``tables.md`` and ``loops.png`` are re-made by the study's own code. The verdicts that moved, each
with the rule that moved it (:mod:`epikv.bench.shared.regrade`), and the paired tests whose call at
0.05 changed go to ``regrade.json`` beside the document. Nothing is generated; a second run finds
nothing to change and writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epikv.bench.loops.runs import Problem, graded_tokens
from epikv.bench.loops.study import LoopsConfig, _batches, dataset_parts
from epikv.bench.loops.summary import FULL, TESTED, markdown, summarize_loops
from epikv.bench.shared import documents
from epikv.bench.shared.regrade import flips, listing, why

Place = tuple[str, int, str]  # (dataset, batch, cell): one part


def document_config(document: dict[str, Any], parts_dir: str | None = None) -> LoopsConfig:
    """The study's configuration as a document records it (``parts_dir`` instead of the recorded
    folder when given); run as one process, whatever shard wrote it."""
    names = {f.name for f in dataclasses.fields(LoopsConfig)}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in document["config"].items() if k in names}
    given.update(shard=None, ray=None, shards=1)
    if parts_dir is not None:
        given["parts_dir"] = parts_dir
    return LoopsConfig(**given)


def regrade_record(
    record: dict[str, Any], problem: Problem, tokenizer: Any
) -> tuple[str, dict[str, Any] | None]:
    """One stored generation (not skipped) graded again: its text, and when its verdict or extracted
    answer changed (``record`` is then updated in place) the change: old and new verdict, extracted
    answers, finish reason and the rule that moved it."""
    if record["prompt_tokens"] != len(problem.prompt):
        raise ValueError(
            f"{problem.dataset}/{problem.example.id}: the record's prompt has {record['prompt_tokens']} "
            f"tokens, the study's {len(problem.prompt)}: it is not this problem's"
        )
    finish = record["finish_reason"]
    text, grade = graded_tokens(problem.task, problem.example, record["token_ids"], finish, tokenizer)
    old, new = (record["correct"], record["extracted"]), (grade.correct, grade.extracted)
    if old == new:
        return text, None
    record["correct"], record["extracted"] = new
    return text, _change(text, finish, old, new, problem.example.problem)


def _change(
    text: str, finish: str, old: tuple[bool, Any], new: tuple[bool, Any], asked: str
) -> dict[str, Any]:
    """A moved grade as ``regrade.json`` lists it: old and new verdict, the rule that moved it, the
    extracted answers and the finish reason (``old``, ``new``: (verdict, extracted answer))."""
    rule = why(text, finish, old[1], new[1], asked)
    return {
        "old": old[0],
        "new": new[0],
        "rule": rule,
        "extracted": [old[1], new[1]],
        "finish_reason": finish,
    }


def regrade_piece(
    records: list[dict[str, Any]], batch: list[Problem], tokenizer: Any
) -> tuple[list[Any], int]:
    """One part's records graded again (:func:`regrade_record`): each record's text (None when
    skipped) and how many changed."""
    texts: list[str | None] = []
    changed = 0
    for record, problem in zip(records, batch, strict=True):
        text, change = regrade_record(record, problem, tokenizer) if "skipped" not in record else (None, None)
        texts.append(text)
        changed += change is not None
    return texts, changed


def regrade_placed(
    records: list[dict[str, Any]],
    problems: dict[tuple[str, int, int], Problem],
    tokenizer: Any,
    run: str,
    cell: str,
) -> dict[str, Any]:
    """Records that carry their place in the study (``dataset``, ``batch``, ``index``, ``id``: the
    vLLM runs of its cells, ``scripts/vllm_loops.py``) graded again, updated in place: the row
    :func:`~epikv.bench.shared.regrade.listing` reads (records, updated, the verdicts that moved).
    A record that stores no verdict (graded only where it is compared) is left as it is."""
    row: dict[str, Any] = {"cell": cell, "records": 0, "updated": 0, "moved": []}
    for record in (r for r in records if "skipped" not in r and "correct" in r):
        place = (record["dataset"], record["batch"], record["index"])
        _, change = regrade_record(record, problems[place], tokenizer)
        row["records"] += 1
        row["updated"] += change is not None
        if change is not None and change["old"] != change["new"]:
            where = {"run": run, "cell": cell, "problem": f"{record['dataset']}/{record['id']}"}
            row["moved"].append({**where, **change})
    return row


def _places(config: LoopsConfig, document: dict[str, Any], work: list[Any]) -> list[tuple[str, int, int]]:
    """(dataset, batch, index) of each of the document's problems, in its order, checked against
    the problems the study batches from its configuration."""
    ours = [(d, b, i, p.example.id) for d, b, batch in work for i, p in enumerate(batch)]
    theirs = [(p["dataset"], p["id"]) for p in document["results"]["problems"]]
    if [(d, e) for d, _, _, e in ours] != theirs:
        raise ValueError(
            f"the document's {len(theirs)} problems are not the {len(ours)} its configuration batches "
            f"(parts folder {config.parts_dir}): it was assembled from part of its batches"
        )
    return [(d, b, i) for d, b, i, _ in ours]


def _regrade_parts(
    config: LoopsConfig, work: list[Any], cells: list[str], tokenizer: Any
) -> tuple[dict[Place, list[dict[str, Any]]], dict[Place, list[Any]], list[Any]]:
    """Every part the document uses, graded again: (records, texts) per part, and the parts to
    write back (a record changed), each as (parts store, batch, cell, piece)."""
    records: dict[Place, list[dict[str, Any]]] = {}
    texts: dict[Place, list[Any]] = {}
    dirty = []
    for dataset, b, batch in work:
        parts = dataset_parts(config.parts_dir, dataset)
        for cell in cells:
            piece = parts.stored(b, cell)
            if piece is None:
                raise FileNotFoundError(f"{parts.folder}: no part b{b:02d} of cell {cell!r}")
            texts[(dataset, b, cell)], changed = regrade_piece(piece["results"], batch, tokenizer)
            records[(dataset, b, cell)] = piece["results"]
            if changed:
                dirty.append((parts, b, cell, piece, changed))
    return records, texts, dirty


def _update_facts(
    run: str,
    work: list[Any],
    places: list[tuple[str, int, int]],
    problems: list[dict[str, Any]],
    records: dict[Place, list[dict[str, Any]]],
    texts: dict[Place, list[Any]],
) -> list[dict[str, Any]]:
    """The document's facts set to their parts' verdicts (in place); per cell the generations
    graded, the facts updated and the verdicts that moved."""
    examples = {(d, b, i): p.example for d, b, batch in work for i, p in enumerate(batch)}
    cells = list(dict.fromkeys(c for p in problems for c in p["cells"]))
    rows = {cell: {"cell": cell, "records": 0, "updated": 0, "moved": []} for cell in cells}
    for (dataset, b, i), problem in zip(places, problems, strict=True):
        for cell, fact in problem["cells"].items():
            if "skipped" in fact:
                continue
            record, text = records[(dataset, b, cell)][i], texts[(dataset, b, cell)][i]
            new = {"correct": bool(record["correct"]), "extracted": record["extracted"]}
            if fact.get("full_correct") is not None:
                new["full_correct"] = bool(records[(dataset, b, FULL)][i]["correct"])
            rows[cell]["records"] += 1
            if all(fact[k] == v for k, v in new.items()):
                continue
            rows[cell]["updated"] += 1
            if fact["correct"] != new["correct"]:
                before, now = (fact["correct"], fact["extracted"]), (new["correct"], new["extracted"])
                change = _change(
                    text, record["finish_reason"], before, now, examples[(dataset, b, i)].problem
                )
                where = {"run": run, "cell": cell, "problem": f"{dataset}/{problem['id']}"}
                rows[cell]["moved"].append({**where, **change})
            fact.update(new)
    return list(rows.values())


def _tests(summary: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """Every paired test of a summary: (which comparison, dataset, pair and property; its p)."""
    for comparison in summary["comparisons"]:
        for dataset, items in comparison["datasets"].items():
            for item in items:
                for reference, test in (item.get("vs") or {}).items():
                    for name in TESTED:
                        if (test or {}).get(name) is not None:
                            where = f"{comparison['kind']} {comparison['target']}/{dataset}"
                            yield f"{where}: {item['cell']} vs {reference} ({name})", test[name]["p_value"]


def regrade_document(path: str | Path, parts_dir: str | None, tokenizer: Any) -> dict[str, Any]:
    """Grades every generation of the loop document at ``path`` again from its parts (``parts_dir``,
    or the folder the document records); updates the parts, the document's facts and its summary,
    tables and figure where a verdict changed, and writes ``regrade.json`` beside it. Returns the
    listing (:func:`epikv.bench.shared.regrade.listing`) with the parts' records changed."""
    path = Path(path)
    document = documents.read_result(path, "loops")
    config = document_config(document, parts_dir)
    if not config.parts_dir or not Path(config.parts_dir).is_dir():
        raise FileNotFoundError(
            f"{path}: its parts folder {config.parts_dir} is not a folder: give --parts-dir"
        )
    work = _batches(config, tokenizer)
    problems = document["results"]["problems"]
    places = _places(config, document, work)
    cells = list(dict.fromkeys(c for p in problems for c in p["cells"]))
    records, texts, dirty = _regrade_parts(config, work, cells, tokenizer)
    rows = _update_facts(str(path.parent), work, places, problems, records, texts)
    result = {**listing(rows), "parts_records_updated": sum(d[4] for d in dirty)}
    if result["moved"]:  # the summary first: a document it cannot re-make leaves every file as it was
        result["flipped"] = _resummarize(path, document["results"], config, len(result["moved"]))
    for parts, b, cell, piece, _ in dirty:
        parts.rewrite(b, cell, piece)
    if result["updated"]:
        _write(path, document, remake=bool(result["moved"]))
        text = json.dumps({"document": str(path), "parts_dir": config.parts_dir, **result}, indent=1)
        (path.parent / "regrade.json").write_text(text + "\n", encoding="utf-8")
    return result


def _resummarize(
    path: Path, results: dict[str, Any], config: LoopsConfig, moved: int
) -> list[dict[str, Any]]:
    """The document's summary re-made from its facts by the study's code (only a verdict changes
    it: it reads no extracted answer); returns the paired tests whose call at 0.05 changed."""
    before = results["summary"]
    try:
        results["summary"] = summarize_loops(results["problems"], results["plan"], config.references)
    except KeyError as err:
        raise ValueError(
            f"{path}: {moved} verdicts moved, but its facts lack {err}, which this version's summary "
            "reads (an older document): its summary cannot be re-made; nothing written"
        ) from None
    return flips(dict(_tests(before)), dict(_tests(results["summary"])))


def _write(path: Path, document: dict[str, Any], remake: bool) -> None:
    """The document as the study writes it, and with ``remake`` (its summary changed) its tables and
    figure where it has them."""
    from epikv.bench.loops.plots import plot_document

    if documents.write_result(document, path.parent) != path:
        raise ValueError(f"{path}: a loops document is named loops.json")
    if not remake:
        return
    tables = path.parent / "tables.md"
    if tables.is_file():  # as `epikv bench table` prints it
        tables.write_text(markdown(document["results"]["summary"]) + "\n", encoding="utf-8")
    if (path.parent / "loops.png").is_file():
        plot_document(path)


def regrade_cells(out: Path, cells: list[str], config: LoopsConfig) -> list[dict[str, Any]]:
    """Each ``OUT/<cell>.json`` of placed records (``scripts/vllm_loops.py``) graded again in place
    by the grader's current rules; ``OUT/regrade.json`` lists the moved verdicts when any record
    changed. Returns one row per cell (``regrade_placed``'s)."""
    from epikv.bench.shared.model_loading import load_bench_tokenizer

    tokenizer = load_bench_tokenizer(None)
    problems = {(d, b, i): p for d, b, batch in _batches(config, tokenizer) for i, p in enumerate(batch)}
    rows = []
    for cell in cells:
        path = out / f"{cell}.json"
        doc = json.loads(path.read_text())
        row = regrade_placed(doc["results"], problems, tokenizer, str(out), cell)
        if row["updated"]:
            path.with_suffix(".tmp").write_text(json.dumps(doc) + "\n")
            path.with_suffix(".tmp").replace(path)
        rows.append(row)
    if any(row["updated"] for row in rows):
        (out / "regrade.json").write_text(json.dumps(listing(rows), indent=1) + "\n")
    return rows
