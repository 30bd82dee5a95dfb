"""The loop study's numbers from its per-problem generations: rates with Wilson intervals, exact
McNemar tests against reference policies, divergence from the full cache, and where loops start.

Pure functions of the document's ``problems`` (one record per problem, one generation per cell,
token ids included) and ``plan`` (which cell answers which level); nothing here runs a model. Loops
are detected here, from the stored token ids, by the eval's two detectors (:mod:`epikv.eval.loops`:
the exact periodic tail, ``loop``, and the one that ignores numbers, ``near_loop``), so their
thresholds can change without generating again. The problem is the unit of every interval and
test: a cell's rate is a count over problems (Wilson, :mod:`epikv.bench.shared.paired`), and two cells are
compared on the problems both ran (exact McNemar).
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from epikv.bench.shared import paired, stats
from epikv.eval.loops import LoopConfig, detect_loop, detect_near_loop, first_divergence

ALL = "all"
FULL = "full"
# Per-problem booleans a cell reports as rates, and those tested pairwise against the references.
RATES = ("correct", "loop", "near_loop", "cap_hit", "bound", "diverged")
TESTED = ("correct", "loop", "near_loop", "cap_hit")
# A cell is flagged as numerically shifted when more than this share of its generations leave
# `full`'s trace before any eviction (issue 33). Until its first eviction a cell's cache is `full`'s,
# so in exact arithmetic the share is 0: it is 0 in every float32 cell of the study. In bf16 batch
# rounding gives the study's 18 own cells 4 to 20% pooled and up to 25% on one dataset (epikv@320 on
# MATH-500, 15 of 59); the bf16 schedule cells, run apart, gave 69 to 90% on each dataset. Half is
# far from both, and reads plainly: most of the cell's generations left `full` before evicting.
SHIFT_LIMIT = 0.5


def loop_timing(onset: int, first_evicted: int | None) -> tuple[str, int | None]:
    """Where a loop starts relative to the first eviction, both as indices of generated tokens:
    ``("no eviction", None)`` when the cache never evicted, ``("before", lag)`` when the loop had
    begun before the first token written from an evicted cache, else ``("after", lag)``; lag =
    onset - first_evicted (negative before)."""
    if first_evicted is None:
        return "no eviction", None
    lag = onset - first_evicted
    return ("before" if lag < 0 else "after"), lag


def facts(
    result: dict[str, Any],
    full: dict[str, Any] | None,
    loops: LoopConfig,
    number_ids: Collection[int] = frozenset(),
) -> dict[str, Any]:
    """What the summary counts about one generation (``result`` as the study stores it, token ids
    included) next to the full cache's generation of the same problem (None when it is missing or
    skipped). A skipped generation stays ``{"skipped": reason}``. ``number_ids``: the tokens the
    near-periodic detector reads as parts of numbers (none: it is the exact detector)."""
    if "skipped" in result:
        return {"skipped": result["skipped"]}
    tokens = result["token_ids"]
    loop = detect_loop(tokens, loops)
    near = detect_near_loop(tokens, number_ids, loops)
    first_evicted = result.get("first_evicted_index")
    out: dict[str, Any] = {
        "correct": bool(result["correct"]),
        "extracted": result.get("extracted"),
        "loop": loop is not None,
        "cap_hit": result["finish_reason"] == "length",
        "bound": first_evicted is not None,
        "length": len(tokens),
        "first_evicted": first_evicted,
        "loop_onset": None if loop is None else loop.onset,
        "loop_period": None if loop is None else loop.period,
        "timing": None if loop is None else loop_timing(loop.onset, first_evicted),
        "near_loop": near is not None,
        "near_loop_onset": None if near is None else near.onset,
    }
    usable = full is not None and "skipped" not in full
    divergence = first_divergence(full["token_ids"], tokens) if usable else None  # type: ignore[index]
    out["diverged"] = usable and divergence is not None
    out["divergence"] = divergence if divergence is not None else (len(tokens) if usable else None)
    out["full_correct"] = bool(full["correct"]) if usable else None  # type: ignore[index]
    for key in ("peak_cache_tokens", "mean_cache_tokens", "seconds"):
        out[key] = result.get(key)
    return out


def problem_facts(
    problem: dict[str, Any], loops: LoopConfig, number_ids: Collection[int] = frozenset()
) -> dict[str, Any]:
    """One problem with every cell's generation reduced to its :func:`facts` (what the document
    keeps: token ids stay in the parts store)."""
    full = problem["cells"].get(FULL)
    cells = {cell: facts(result, full, loops, number_ids) for cell, result in problem["cells"].items()}
    return {**{k: v for k, v in problem.items() if k != "cells"}, "cells": cells}


def left_before_eviction(found: dict[str, Any]) -> bool:
    """Whether a generation (its :func:`facts`) left `full`'s trace before its cache first evicted:
    its first divergence comes before ``first_evicted`` (or it diverged and never evicted). Before
    the first eviction the cache holds what `full`'s holds, so such a departure is numerics (batch
    rounding, another run's arithmetic), not eviction."""
    if not found.get("diverged"):
        return False
    first_evicted = found.get("first_evicted")
    return first_evicted is None or found["divergence"] < first_evicted


def _bootstrap_ci(values: list[float]) -> list[float] | None:
    if not values:
        return None
    found = stats.bootstrap_mean(values)
    return [round(found.mean, 3), round(found.low, 3), round(found.high, 3)]


def _rate(successes: int, n: int) -> dict[str, Any] | None:
    found = paired.wilson(successes, n)
    return None if found is None else {k: round(v, 5) for k, v in found._asdict().items()}


def cell_facts(problems: list[dict[str, Any]], cell: str) -> dict[str, dict[str, Any]]:
    """problem key -> facts of one cell's generation, for the problems it ran (skips left out)."""
    found = {}
    for p in problems:
        result = p["cells"].get(cell)
        if result is not None and "skipped" not in result:
            found[f"{p['dataset']}/{p['id']}"] = result
    return found


def cell_row(problems: list[dict[str, Any]], cell: str) -> dict[str, Any]:
    """One cell on some problems: every rate with its Wilson interval, length, divergence, where
    loops start, the problems lost against the full cache, memory and cost."""
    done = list(cell_facts(problems, cell).values())
    results = [p["cells"][cell] for p in problems if cell in p["cells"]]
    row: dict[str, Any] = {"problems": len(done), "skipped": len(results) - len(done)}
    for name in RATES:
        row[name] = _rate(sum(f[name] for f in done), len(done))
    compared = [f for f in done if f["divergence"] is not None]  # those `full` ran too
    early = _rate(sum(left_before_eviction(f) for f in compared), len(compared))
    row["left_before_eviction"] = early  # numerics, not eviction: see SHIFT_LIMIT
    row["shifted"] = early is not None and early["rate"] > SHIFT_LIMIT
    finished = [f for f in done if not f["cap_hit"]]
    row["correct_finished"] = _rate(sum(f["correct"] for f in finished), len(finished))
    row["length"] = _bootstrap_ci([f["length"] for f in done])
    row["first_divergence"] = _bootstrap_ci([f["divergence"] for f in done if f["divergence"] is not None])
    lags = [f["divergence"] - f["first_evicted"] for f in done if f["diverged"] and f["bound"]]
    row["divergence_after_first_eviction"] = _quartiles(lags)
    timings = [f["timing"] for f in done if f["timing"] is not None]
    row["loop_start"] = {
        kind: sum(t[0] == kind for t in timings) for kind in ("no eviction", "before", "after")
    }
    row["loop_start"]["lag_after"] = _quartiles([lag for kind, lag in timings if kind == "after"])
    row["detectors"] = {  # how the exact and the near-periodic detector agree on this cell
        "both": sum(f["loop"] and f["near_loop"] for f in done),
        "exact_only": sum(f["loop"] and not f["near_loop"] for f in done),
        "near_only": sum(f["near_loop"] and not f["loop"] for f in done),
    }
    lost = [f for f in done if f["full_correct"] and not f["correct"]]
    row["lost_vs_full"] = {
        "problems": len(lost),
        "looped": sum(f["loop"] for f in lost),
        "cap_hit": sum(f["cap_hit"] for f in lost),
    }
    row["gained_vs_full"] = sum(f["full_correct"] is False and f["correct"] for f in done)
    means = [f["mean_cache_tokens"] for f in done if f.get("mean_cache_tokens") is not None]
    row["mean_cache_tokens"] = round(statistics.fmean(means), 1) if means else None
    row["peak_cache_tokens"] = max((f["peak_cache_tokens"] or 0 for f in done), default=None)
    row["tokens"] = sum(f["length"] for f in done)
    return row


def _quartiles(values: list[int]) -> list[float] | None:
    """[25th, 50th, 75th] percentiles (numpy's linear rule), None when empty."""
    return np.percentile(values, [25, 50, 75]).round(1).tolist() if values else None


def paired_row(problems: list[dict[str, Any]], cell: str, reference: str) -> dict[str, Any]:
    """``cell`` against ``reference`` on the problems both ran: an exact McNemar test per property
    of :data:`TESTED` (difference = cell's rate - reference's)."""
    mine, theirs = cell_facts(problems, cell), cell_facts(problems, reference)
    both = [key for key in mine if key in theirs]
    out: dict[str, Any] = {"reference": reference, "problems": len(both)}
    for name in TESTED:
        if not both:
            out[name] = None
            continue
        test = paired.mcnemar_exact([mine[k][name] for k in both], [theirs[k][name] for k in both])
        out[name] = {k: _round(v) if isinstance(v, float) else v for k, v in test._asdict().items()}
    return out


def _round(value: float) -> float:
    """5 decimals, or 4 significant digits below 0.001: an exact p can be far below 1e-5 (issue 28:
    the near-periodic detector's rkv@192 against full is 6e-7), and 0 would misreport it."""
    return round(value, 5) if abs(value) >= 1e-3 or value == 0 else float(f"{value:.4g}")


def _datasets(problems: list[dict[str, Any]]) -> list[str]:
    names = list(dict.fromkeys(p["dataset"] for p in problems))
    return [*names, ALL] if len(names) > 1 else names


def _pick(problems: list[dict[str, Any]], dataset: str) -> list[dict[str, Any]]:
    return problems if dataset == ALL else [p for p in problems if p["dataset"] == dataset]


def summarize_loops(
    problems: list[dict[str, Any]], plan: list[dict[str, Any]], references: Sequence[str]
) -> dict[str, Any]:
    """Rows per (dataset, cell) of problems reduced by :func:`problem_facts`, and the comparisons:
    per level, each cell against each reference policy's cell of that level (``full`` is the
    reference of every level)."""
    datasets = _datasets(problems)
    cells = list(dict.fromkeys(e["cell"] for e in plan if e.get("cell")))
    rows = {d: {c: cell_row(_pick(problems, d), c) for c in cells} for d in datasets}
    comparisons = []
    for kind in ("peak", "sweep"):
        for target in dict.fromkeys(e["target"] for e in plan if e["kind"] == kind):
            entries = [e for e in plan if e["kind"] == kind and e["target"] == target]
            refs = {r: _reference_cell(plan, entries, r) for r in references}
            listed: dict[str, list[dict[str, Any]]] = {}
            for d in datasets:
                listed[d] = []
                for e in entries:
                    item = {"label": e["label"], "cell": e.get("cell"), "budget": e.get("budget")}
                    if e.get("cell") is None:
                        item["why"] = e["why"]
                    else:
                        item["vs"] = {
                            r: paired_row(_pick(problems, d), e["cell"], c)
                            for r, c in refs.items()
                            if c is not None and c != e["cell"]
                        }
                    listed[d].append(item)
            comparisons.append({"kind": kind, "target": target, "references": refs, "datasets": listed})
    return {"datasets": datasets, "rows": rows, "comparisons": comparisons}


def shifted_cells(summary: dict[str, Any]) -> dict[str, float]:
    """Cell -> its pooled share of generations that left `full`'s trace before any eviction, for
    the cells over :data:`SHIFT_LIMIT` (what a run warns about)."""
    if not summary["datasets"]:  # a shard whose batches are not complete yet
        return {}
    rows = summary["rows"][summary["datasets"][-1]]  # pooled when there are several datasets
    return {c: r["left_before_eviction"]["rate"] for c, r in rows.items() if r.get("shifted")}


def _reference_cell(plan: list[dict[str, Any]], entries: list[dict[str, Any]], label: str) -> str | None:
    if label == FULL:
        return next((e["cell"] for e in plan if e["label"] == FULL), None)
    return next((e["cell"] for e in entries if e["label"] == label and e.get("cell")), None)


# --------------------------------------------------------------------------- markdown


def _pct(rate: dict[str, Any] | None) -> str:
    if rate is None:
        return "–"
    return f"{rate['successes']}/{rate['n']} [{100 * rate['low']:.0f}, {100 * rate['high']:.0f}]%"


def _test(item: dict[str, Any], reference: str, name: str) -> str:
    test = (item.get("vs") or {}).get(reference, {}).get(name)
    if test is None:
        return "–"
    return f"{100 * test['difference']:+.1f} pt, p={test['p_value']:.2g}"


def comparison_table(summary: dict[str, Any], kind: str, target: Any, dataset: str) -> str:
    """Markdown: one row per cell of one comparison on one dataset, fewest loops first. Rates are
    successes/n [Wilson 95%]; a test is the paired difference in points and its exact McNemar p."""
    comparison = next(c for c in summary["comparisons"] if c["kind"] == kind and c["target"] == target)
    rows = summary["rows"][dataset]
    refs = [r for r, c in comparison["references"].items() if c is not None]
    header = [
        "policy",
        "K",
        "loops",
        "near loops",
        "loops: both / exact only / near only",
        "cap hits",
        "accuracy",
        "acc. finished",
        "mean length",
        "bound",
        "diverged from full",
        "left full before any eviction",
        "loop start: no eviction / before / after 1st eviction",
        "lost vs full (looped, cap)",
    ]
    header += [f"Δ loops vs {r}" for r in refs] + [f"Δ near loops vs {r}" for r in refs]
    header += [f"Δ accuracy vs {r}" for r in refs] + ["mean cached"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def rank(item: dict[str, Any]) -> float:
        rate = rows[item["cell"]]["loop"] if item.get("cell") else None
        return float("inf") if rate is None else rate["rate"]

    for item in sorted(comparison["datasets"][dataset], key=rank):
        if item.get("cell") is None:
            lines.append(f"| {item['label']} | – | cannot match: {item['why']} |" + " |" * (len(header) - 3))
            continue
        row = rows[item["cell"]]
        start, lost = row["loop_start"], row["lost_vs_full"]
        agree = row.get("detectors")  # absent from documents written before the second detector
        cells = [
            item["label"], "–" if item["budget"] is None else str(item["budget"]),
            _pct(row["loop"]), _pct(row.get("near_loop")),
            "–" if agree is None else f"{agree['both']} / {agree['exact_only']} / {agree['near_only']}",
            _pct(row["cap_hit"]), _pct(row["correct"]), _pct(row["correct_finished"]),
            "–" if row["length"] is None else f"{row['length'][0]:.0f}", _pct(row["bound"]),
            _pct(row["diverged"]), _shift(row, item["cell"]),
            f"{start['no eviction']} / {start['before']} / {start['after']}",
            f"{lost['problems']} ({lost['looped']}, {lost['cap_hit']})",
            *(_test(item, r, "loop") for r in refs), *(_test(item, r, "near_loop") for r in refs),
            *(_test(item, r, "correct") for r in refs),
            "–" if row["mean_cache_tokens"] is None else f"{row['mean_cache_tokens']:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    shifted = [
        i["label"]
        for i in comparison["datasets"][dataset]
        if i.get("cell") and rows[i["cell"]].get("shifted")
    ]
    if shifted:
        lines.append(
            f"\n**Shifted** ({', '.join(shifted)}): more than {SHIFT_LIMIT:.0%} of the generations left "
            "`full`'s trace before any eviction: most of their differences from `full`, and from cells "
            "that are not shifted, come from numerics, not eviction."
        )
    return "\n".join(lines)


def _shift(row: dict[str, Any], cell: str) -> str:
    """The share that left `full`'s trace before any eviction, marked when over SHIFT_LIMIT; "–" for
    `full` itself and for documents written before issue 33."""
    if cell == FULL or row.get("left_before_eviction") is None:
        return "–"
    return _pct(row["left_before_eviction"]) + (" **shifted**" if row["shifted"] else "")


def markdown(summary: dict[str, Any], datasets: Sequence[str] | None = None) -> str:
    """Every comparison of the summary as markdown tables."""
    out = []
    for comparison in summary["comparisons"]:
        for dataset in datasets or summary["datasets"]:
            what = "equal peak memory" if comparison["kind"] == "peak" else "equal K (sweep)"
            out.append(f"#### {dataset}, {what} = {comparison['target']}\n")
            out.append(comparison_table(summary, comparison["kind"], comparison["target"], dataset) + "\n")
    return "\n".join(out)
