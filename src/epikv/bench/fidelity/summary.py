"""The fidelity study's numbers from its per-prompt results: intervals, equal-K and equal-peak tables.

Pure functions of the document's ``prompts`` (one record per prompt, one result per cell) and
``plan`` (which cell answers which budget or peak); nothing here runs a model. Every interval is a
bootstrap over prompts (:mod:`epikv.bench.shared.stats`): the prompt is the unit, its tokens are not
independent. Comparisons with the reference policy (``streaming`` by default) are paired: the same
prompts, a bootstrap of the per-prompt differences.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np

from epikv.bench.shared import stats

# Per-prompt means the table reports with intervals; higher is better only for agreement.
METRICS = (
    "agreement",
    "agreement_after_eviction",
    "agreement_tail",
    "kl",
    "kl_after_eviction",
    "kl_tail",
    "nll",
    "nll_after_eviction",
    "nll_tail",
    "nll_excess_after_eviction",
)
PAIRED = ("agreement_tail", "kl_tail", "nll_tail", "agreement")
ALL = "all"


def _value(result: dict[str, Any], metric: str) -> float | None:
    if metric == "nll_excess_after_eviction":
        a, b = result.get("nll_after_eviction"), result.get("full_nll_after_eviction")
        return None if a is None or b is None else a - b
    return result.get(metric)


def _bootstrap_ci(values: list[float], seed: int = 0) -> list[float] | None:
    if not values:
        return None
    found = stats.bootstrap_mean(values, seed=seed)
    return [round(found.mean, 5), round(found.low, 5), round(found.high, 5)]


def _genres(prompts: list[dict[str, Any]]) -> list[str]:
    names = list(dict.fromkeys(p["genre"] for p in prompts))
    return [*names, ALL] if len(names) > 1 else names


def _pick(prompts: list[dict[str, Any]], genre: str) -> list[dict[str, Any]]:
    return prompts if genre == ALL else [p for p in prompts if p["genre"] == genre]


def cell_row(prompts: list[dict[str, Any]], cell: str) -> dict[str, Any]:
    """One cell on some prompts: intervals of every metric, memory, free running, what it keeps."""
    results = [p["cells"][cell] for p in prompts if cell in p["cells"]]
    done = [r for r in results if "skipped" not in r]
    row: dict[str, Any] = {"prompts": len(done), "skipped": len(results) - len(done)}
    for metric in METRICS:
        row[metric] = _bootstrap_ci([v for r in done if (v := _value(r, metric)) is not None])
    peaks = [r["peak_cache_tokens"] for r in done]
    means = [r["mean_cache_tokens"] for r in done if r.get("mean_cache_tokens") is not None]
    row["peak_cache_tokens"] = max(peaks) if peaks else None
    row["mean_peak_cache_tokens"] = statistics.fmean(peaks) if peaks else None
    row["mean_cache_tokens"] = statistics.fmean(means) if means else None
    # free running: a run that never left the full cache's trace diverges at its end
    free = [
        (p["cells"][cell], p["trace_tokens"]) for p in prompts if "loop_period" in p["cells"].get(cell, {})
    ]
    row["free_runs"] = len(free)
    row["loop_rate"] = statistics.fmean(r["loop_period"] is not None for r, _ in free) if free else None
    divergence = [float(n if r["first_divergence"] is None else r["first_divergence"]) for r, n in free]
    row["first_divergence"] = _bootstrap_ci(divergence)
    hists = [r["kept_histogram"] for r in done if r.get("kept_histogram")]
    row["kept_histogram"] = np.mean(hists, axis=0).round(5).tolist() if hists else None
    shares = [r["kept_prompt_share"] for r in done if r.get("kept_prompt_share") is not None]
    row["kept_prompt_share"] = statistics.fmean(shares) if shares else None
    return row


def paired_rows(prompts: list[dict[str, Any]], cell: str, reference: str) -> dict[str, Any]:
    """cell minus reference on the prompts both ran: a paired interval per metric of ``PAIRED``."""
    both = [p["cells"] for p in prompts if cell in p["cells"] and reference in p["cells"]]
    both = [c for c in both if "skipped" not in c[cell] and "skipped" not in c[reference]]
    out: dict[str, Any] = {"reference": reference, "prompts": len(both)}
    for metric in PAIRED:
        pairs = [(c[cell][metric], c[reference][metric]) for c in both]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            out[metric] = None
            continue
        found = stats.paired_difference([a for a, _ in pairs], [b for _, b in pairs])
        out[metric] = [round(found.mean, 5), round(found.low, 5), round(found.high, 5)]
    return out


def summarize_fidelity(
    prompts: list[dict[str, Any]], plan: list[dict[str, Any]], config: Any
) -> dict[str, Any]:
    """Rows per (genre, cell), the full cache per genre, and the comparisons the plan asks for: per
    budget (equal K) and per peak (equal peak memory), each policy's cell and its paired difference
    from the reference policy's cell of the same comparison."""
    genres = _genres(prompts)
    cells = list(dict.fromkeys(entry["cell"] for entry in plan if entry.get("cell")))
    rows = {g: {cell: cell_row(_pick(prompts, g), cell) for cell in cells} for g in genres}
    full = {}
    for g in genres:
        chosen = _pick(prompts, g)
        full[g] = {
            "prompts": len(chosen),
            "nll": _bootstrap_ci([p["full_nll"] for p in chosen]),
            "nll_tail": _bootstrap_ci([p["full_nll_tail"] for p in chosen]),
            "loop_rate": statistics.fmean(p["full_loop_period"] is not None for p in chosen),
        }
    comparisons = []
    for kind in ("budget", "peak"):
        for target in dict.fromkeys(e["target"] for e in plan if e["kind"] == kind):
            entries = [e for e in plan if e["kind"] == kind and e["target"] == target]
            reference = next(
                (e["cell"] for e in entries if e["label"] == config.reference and e.get("cell")), None
            )
            comparison = {"kind": kind, "target": target, "reference": reference, "genres": {}}
            for g in genres:
                listed = []
                for e in entries:
                    item = {"label": e["label"], "cell": e.get("cell"), "budget": e["budget"]}
                    if e.get("cell") is None:
                        item["why"] = e["why"]
                    elif reference is not None and e["cell"] != reference:
                        item["vs_reference"] = paired_rows(_pick(prompts, g), e["cell"], reference)
                    listed.append(item)
                comparison["genres"][g] = listed
            comparisons.append(comparison)
    return {"genres": genres, "rows": rows, "full": full, "comparisons": comparisons}


# --------------------------------------------------------------------------- markdown


def _ci(value: list[float] | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    mean, low, high = value
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def comparison_table(
    summary: dict[str, Any], kind: str, target: int, genre: str, metric: str = "agreement_tail"
) -> str:
    """Markdown: one row per policy of one comparison on one genre, best ``metric`` first; ``*``
    marks a paired difference from the reference whose interval excludes 0."""
    comparison = next(c for c in summary["comparisons"] if c["kind"] == kind and c["target"] == target)
    rows = summary["rows"][genre]
    header = [
        "policy",
        "K",
        f"{metric} [95% CI]",
        "agreement after eviction",
        "KL tail",
        f"Δ vs {comparison['reference'] or '–'} (paired)",
        "peak / mean cached",
        "loop rate",
        "first divergence",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def rank(item: dict[str, Any]) -> float:
        value = rows[item["cell"]][metric] if item.get("cell") else None
        return float("inf") if value is None else -value[0]

    for item in sorted(comparison["genres"][genre], key=rank):
        if item.get("cell") is None:
            lines.append(f"| {item['label']} | – | cannot match: {item['why']} |" + " |" * 6)
            continue
        row = rows[item["cell"]]
        delta = (item.get("vs_reference") or {}).get(metric)
        mark = " *" if delta is not None and (delta[1] > 0 or delta[2] < 0) else ""
        cells = [
            item["label"],
            str(item["budget"]),
            _ci(row[metric]),
            _ci(row["agreement_after_eviction"]),
            _ci(row["kl_tail"]),
            _ci(delta) + mark,
            f"{_num(row['peak_cache_tokens'])} / {_num(row['mean_cache_tokens'])}",
            _num(row["loop_rate"], 2),
            _ci(row["first_divergence"], 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(
    summary: dict[str, Any], genres: Iterable[str] | None = None, metric: str = "agreement_tail"
) -> str:
    """Every comparison of the summary as markdown tables (``*``: the paired interval excludes 0)."""
    out = []
    for comparison in summary["comparisons"]:
        for genre in genres or summary["genres"]:
            what = "equal K" if comparison["kind"] == "budget" else "equal peak memory"
            out.append(f"#### {genre}, {what} = {comparison['target']}\n")
            out.append(
                comparison_table(summary, comparison["kind"], comparison["target"], genre, metric) + "\n"
            )
    return "\n".join(out)
