"""The accuracy study's numbers, recomputed from its run folders alone (no model runs).

Per cell: accuracy with its Wilson interval, cap hits, and loops by the loop study's two detectors
(the exact periodic tail and the one that ignores numbers), recomputed from the records' token ids.
Per budget level: the problems every cell at that K could run (a problem one policy cannot
protect is excluded for all, and named), each policy against ``full`` and each pair of policies,
paired on those problems (exact McNemar), Holm-adjusted within a named family; what each policy's
lost accuracy is made of (problems ``full`` solves and the policy does not: how many of them loop
or hit the cap); and the same pairs at equal peak memory (K + tau equal). The noise cells give the
floor: how often a verdict changes when only the engine, the compile mode or the batch changes.
The paper's headline pairs (``Study.headline``) are tested on every problem both of their cells
ran, a family of their own, so that they can be read before a whole budget level is complete.

Owns the statistics; the design is ``design.py``'s and the reading of run folders the eval's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epikv.bench.accuracy.design import Cell, Study, budgets_by_rule
from epikv.bench.shared.paired import mcnemar_exact, wilson
from epikv.eval.loops import LoopConfig, detect_loop, detect_near_loop, first_divergence
from epikv.eval.plan import plan_run
from epikv.eval.records import ExampleResult, load_run_results, load_skipped

NUMBER_IDS = "number_ids.json"


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (same order as given)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, (len(p_values) - rank) * p_values[i])
        adjusted[i] = min(1.0, running)
    return adjusted


def _rate(flags: Sequence[bool]) -> dict[str, Any] | None:
    found = wilson(sum(flags), len(flags))
    return None if found is None else {"k": found.successes, "n": found.n, "rate": found.rate,
                                       "ci95": [found.low, found.high]}  # fmt: skip


class CellData:
    """One cell's records on its selection, its skips, and its per-problem facts."""

    def __init__(self, study: Study, cell: Cell, out: str, numbers: frozenset[int], loops: LoopConfig):
        plan = plan_run(cell.config(out, study.model, study.dtype, progress=False))
        self.cell, self.folder, self.order = cell, plan.folder, [e.id for e in plan.task]
        self.complete = not plan.work  # every problem run or skipped: the cell owes nothing
        selected = plan.selected_keys
        found = load_run_results(plan.folder) if plan.folder.is_dir() else []
        self.records: dict[str, ExampleResult] = {r.id: r for r in found if r.key in selected}
        skips = load_skipped(plan.folder) if plan.folder.is_dir() else []
        self.skipped = {s.id: s.reason for s in skips if s.key in selected}
        spec_path = plan.folder / "spec.json"
        spec = json.loads(spec_path.read_text()) if spec_path.is_file() else {}
        self.tau = spec.get("interval") if cell.budget is not None else None  # full never compacts
        self.facts = {i: _facts(r, numbers, loops) for i, r in self.records.items()}

    @property
    def peak(self) -> int | None:
        return None if self.cell.budget is None or self.tau is None else self.cell.budget + self.tau


def _facts(record: ExampleResult, numbers: frozenset[int], loops: LoopConfig) -> dict[str, Any]:
    tokens = record.token_ids or []
    return {
        "correct": record.correct, "cap_hit": record.cap_hit, "tokens": record.tokens_generated,
        "loop": detect_loop(tokens, loops) is not None,
        "near_loop": detect_near_loop(tokens, numbers, loops) is not None,
        "evicted": record.evictions > 0, "peak": record.peak_cache_tokens, "seconds": record.seconds,
        "total": record.prompt_tokens + record.tokens_generated,
    }  # fmt: skip


def cell_row(data: CellData) -> dict[str, Any]:
    facts = list(data.facts.values())
    seconds = sum(f["seconds"] for f in facts)
    tokens = sum(f["tokens"] for f in facts)
    return {
        "cell": data.cell.name, "policy": data.cell.policy, "budget": data.cell.budget, "tau": data.tau,
        "peak_budget": data.peak, "engine": data.cell.engine, "done": len(facts),
        "skipped": len(data.skipped), "of": data.cell.problems,
        **{name: _rate([f[name] for f in facts]) for name in ("correct", "cap_hit", "loop", "near_loop")},
        "evicted": _rate([f["evicted"] for f in facts]),
        "mean_tokens": tokens / len(facts) if facts else None,
        "mean_peak_cache": sum(f["peak"] for f in facts) / len(facts) if facts else None,
        "tokens_per_s": tokens / seconds if seconds else None,
    }  # fmt: skip


def paired(a: CellData, b: CellData, ids: Sequence[str], what: str = "correct") -> dict[str, Any]:
    test = mcnemar_exact([a.facts[i][what] for i in ids], [b.facts[i][what] for i in ids])
    return {"a": a.cell.name, "b": b.cell.name, "what": what, "n": test.n, "a_only": test.a_only,
            "b_only": test.b_only, "difference": test.difference, "p": test.p_value}  # fmt: skip


def common_ids(cells: Sequence[CellData]) -> tuple[list[str], list[str]]:
    """The problems every cell has a record for, in the study's order, and the ones some cell
    skipped (a prompt it cannot protect at its K): excluded for all."""
    excluded = sorted({i for c in cells for i in c.skipped})
    ids = [i for i in cells[0].order if all(i in c.records for c in cells) and i not in excluded]
    return ids, excluded


def lost(policy: CellData, full: CellData, ids: Sequence[str]) -> dict[str, Any]:
    """Problems ``full`` solves and ``policy`` does not, and how many of them loop or hit the cap
    (the v3 claim: most accuracy lost to eviction is generations that loop to the cap)."""
    gone = [i for i in ids if full.facts[i]["correct"] and not policy.facts[i]["correct"]]
    count = {k: sum(policy.facts[i][k] for i in gone) for k in ("loop", "near_loop", "cap_hit")}
    either = sum(policy.facts[i]["near_loop"] or policy.facts[i]["cap_hit"] for i in gone)
    gained = sum(policy.facts[i]["correct"] and not full.facts[i]["correct"] for i in ids)
    return {"lost": len(gone), "gained": gained, **count, "loop_or_cap": either}


def level(cells: Sequence[CellData], full: CellData) -> dict[str, Any]:
    """One budget level (or one peak): the common problems, every policy against full (family:
    these comparisons, Holm) and every pair of policies (family: these pairs, Holm), loops too."""
    ids, excluded = common_ids([full, *cells])
    out: dict[str, Any] = {"n": len(ids), "excluded": excluded, "cells": [c.cell.name for c in cells]}
    if not ids:
        return out
    versus = [paired(c, full, ids) for c in cells]
    for row, p in zip(versus, holm([r["p"] for r in versus]), strict=True):
        row["p_holm"] = p
    out["vs_full"] = {"family": f"{len(versus)} policies against full, correct, Holm", "tests": versus}
    pairs = [paired(a, b, ids) for a, b in itertools.combinations(cells, 2)]
    for row, p in zip(pairs, holm([r["p"] for r in pairs]), strict=True):
        row["p_holm"] = p
    out["pairs"] = {"family": f"{len(pairs)} pairs of policies, correct, Holm", "tests": pairs}
    loops = [paired(a, b, ids, "near_loop") for a, b in itertools.combinations([full, *cells], 2)]
    for row, p in zip(loops, holm([r["p"] for r in loops]), strict=True):
        row["p_holm"] = p
    out["loops"] = {"family": f"{len(loops)} pairs, near loops, Holm", "tests": loops}
    out["lost"] = {c.cell.name: lost(c, full, ids) for c in cells}
    out["accuracy"] = {c.cell.name: _rate([c.facts[i]["correct"] for i in ids]) for c in [full, *cells]}
    return out


def read_level(cells: Sequence[CellData], full: CellData) -> dict[str, Any]:
    """:func:`level` on every cell; while some cells are partial, also (``whole``) on the complete
    cells alone, a family of its own, so that the finished part of a level reads on all its
    problems, not only on the partial cells' first ones."""
    out = level(cells, full)
    whole = [c for c in cells if c.complete]
    if 1 < len(whole) < len(cells):
        out["whole"] = level(whole, full)
    return out


def headline(pairs: Sequence[tuple[CellData, CellData]], full: CellData) -> dict[str, Any]:
    """The headline pairs (``Study.headline``), each on every problem both of its cells ran (a
    problem either skipped is out), correct, Holm within these pairs; and what each of their cells
    but ``full`` lost against ``full``, on the problems the two both ran."""
    tests = []
    for a, b in pairs:
        ids, excluded = common_ids([a, b])
        if ids:
            accuracy = {c.cell.name: _rate([c.facts[i]["correct"] for i in ids]) for c in (a, b)}
            tests.append(paired(a, b, ids) | {"excluded": excluded, "accuracy": accuracy})
    for row, p in zip(tests, holm([r["p"] for r in tests]), strict=True):
        row["p_holm"] = p
    family = f"{len(tests)} headline comparisons, each on the problems both cells ran, correct, Holm"
    losses = {}
    for cell in dict.fromkeys(c for pair in pairs for c in pair if c is not full):
        ids = common_ids([cell, full])[0]
        losses[cell.cell.name] = lost(cell, full, ids) | {"n": len(ids)}
    return {"family": family, "tests": tests, "lost": losses}


def noise(cell: CellData, base: CellData) -> dict[str, Any]:
    """A noise cell against the main cell it repeats: verdicts and token streams that changed."""
    ids = [i for i in cell.order if i in cell.records and i in base.records]
    if not ids:
        return {"against": base.cell.name, "n": 0}
    changed = sum(cell.facts[i]["correct"] != base.facts[i]["correct"] for i in ids)
    same = sum(first_divergence(base.records[i].token_ids or [], cell.records[i].token_ids or []) is None
               for i in ids)  # fmt: skip
    return {"against": base.cell.name, "n": len(ids), "verdict_changed": _rate([
        cell.facts[i]["correct"] != base.facts[i]["correct"] for i in ids]), "changed": changed,
        "identical_tokens": same, "test": paired(cell, base, ids)}  # fmt: skip


def summarize(study: Study, out: str, numbers: frozenset[int]) -> dict[str, Any]:
    loops = LoopConfig(min_span=study.loop_min_span)
    data = {c.name: CellData(study, c, out, numbers, loops) for c in study.cells()}
    result: dict[str, Any] = {"cells": {n: cell_row(d) for n, d in data.items()}, "arms": {}, "noise": {}}
    for arm in study.arms:
        full = data[f"{arm.name}/full@full"]
        arm_out: dict[str, Any] = {"levels": {}, "equal_peak": {}}
        totals = [full.facts[i]["total"] for i in full.order[: study.budget_problems] if i in full.facts]
        if totals:
            arm_out["budget_rule"] = {"from_problems": len(totals), "rule": list(budgets_by_rule(totals)),
                                      "chosen": list(arm.budgets)}  # fmt: skip
        mine = [d for d in data.values() if d.cell.arm == arm.name and not d.cell.tag and d.records]
        for k in arm.budgets:
            at_k = [d for d in mine if d.cell.budget == k]
            if at_k:
                arm_out["levels"][str(k)] = read_level(at_k, full)
        peaks = sorted({d.peak for d in mine if d.peak is not None})
        for peak in peaks:
            same = [d for d in mine if d.peak == peak]
            if len(same) > 1:
                arm_out["equal_peak"][str(peak)] = read_level(same, full)
        pairs = [(data[a], data[b]) for a, b in study.headline(arm) if data[a].records and data[b].records]
        if pairs:
            arm_out["headline"] = headline(pairs, full)
        result["arms"][arm.name] = arm_out
    for cell in study.noise_cells():
        base = next(d for d in data.values() if not d.cell.tag and (d.cell.arm, d.cell.policy,
                    d.cell.budget) == (cell.arm, cell.policy, cell.budget))  # fmt: skip
        result["noise"][cell.tag] = noise(data[cell.name], base)
    return result


def repeats(study: Study, out: str, repeat: str, numbers: frozenset[int]) -> dict[str, Any]:
    """Cells of the study run again into the folder ``repeat`` (the same cells, code and problems,
    on another machine, such as another kind of CPU): each against the cell in ``out``, as a noise
    cell is against its main cell. Only cells the repeat holds records for are compared."""
    loops = LoopConfig(min_span=study.loop_min_span)
    found: dict[str, Any] = {}
    for cell in study.cells():
        again = CellData(study, cell, repeat, numbers, loops)
        if again.records:
            found[cell.name] = noise(again, CellData(study, cell, out, numbers, loops))
    return found


def number_ids(out: str, model: str) -> frozenset[int]:
    """The model's number tokens (the near-loop detector's), read from ``out/number_ids.json`` or
    computed from the tokenizer once and written there, so later summaries need no model files."""
    path = Path(out) / NUMBER_IDS
    if path.is_file():
        return frozenset(json.loads(path.read_text())["ids"])
    from epikv.eval.loops import number_token_ids
    from epikv.models import load_tokenizer

    ids = number_token_ids(load_tokenizer(model))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "ids": sorted(ids)}) + "\n", encoding="utf-8")
    return ids
