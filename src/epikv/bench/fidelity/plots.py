"""Figures of the fidelity study, drawn from its result document alone.

``plot_document`` writes the main figure (per comparison and genre: the cells ranked by top-1
agreement over the common tail window, 95% intervals, the reference policy's interval shaded, and
the memory each cell held beside them; :mod:`epikv.bench.shared.ci_plots`) and, beside it,
``<name>-kept.png``: where each policy's kept tokens sit (kept-position histograms pooled over
compactions, layers, heads and prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epikv.bench.shared import documents, figures
from epikv.bench.shared.ci_plots import Ranked, memory_panel, rank, ranked_panel


def _ranked(label: str, value: list[float] | None) -> Ranked:
    return Ranked(label, None, None, None) if value is None else Ranked(label, *value)


def plot_document(
    json_path: str | Path, png: str | Path | None = None, metric: str = "agreement_tail"
) -> Path:
    """One row of panels per comparison (each equal K, each equal peak): per genre, the cells ranked
    by ``metric`` with 95% intervals and the reference policy's interval shaded; last, the memory
    each cell held (pooled genre), in the ranking of the last genre."""
    data = documents.read_result(json_path, "fidelity")
    results = data["results"]
    summary = results["summary"]
    genres, comparisons = summary["genres"], summary["comparisons"]
    higher = not metric.startswith(("kl", "nll"))
    figure, axes = figures.new_figure(width=3.4 * (len(genres) + 1), height=0.4 * 12 * len(comparisons) + 0.8)
    axes[0].remove()
    grid = figure.subplots(len(comparisons), len(genres) + 1, squeeze=False)
    for r, comparison in enumerate(comparisons):
        what = "equal K" if comparison["kind"] == "budget" else "equal peak memory"
        order: list[str] = []
        for c, genre in enumerate(genres):
            rows = summary["rows"][genre]
            items = {i["label"]: i["cell"] for i in comparison["genres"][genre] if i.get("cell")}
            ranked = rank([_ranked(label, rows[cell][metric]) for label, cell in items.items()], higher)
            ref_label = next((k for k, v in items.items() if v == comparison["reference"]), None)
            reference = None if ref_label is None else _ranked(ref_label, rows[items[ref_label]][metric])
            ranked_panel(grid[r][c], ranked, reference, metric.replace("_", " "))
            grid[r][c].set_title(f"{genre}, {what} {comparison['target']}", fontsize=8, loc="left")
            order = [row.label for row in ranked]
        rows = summary["rows"][genres[-1]]
        cells = {i["label"]: i["cell"] for i in comparison["genres"][genres[-1]] if i.get("cell")}
        memory_panel(
            grid[r][-1],
            order,
            [rows[cells[label]]["mean_cache_tokens"] for label in order],
            [rows[cells[label]]["peak_cache_tokens"] for label in order],
        )
    cfg = data["config"]
    figure.suptitle(
        f"{results['model']}: T={cfg['trace_tokens']}, tail = last {cfg['tail_tokens']} tokens "
        f"(grey: the reference policy's 95% interval)",
        fontsize=9,
    )
    out = figures.save_figure(figure, png or figures.png_path(json_path))
    plot_kept(data, out.with_name(out.stem + "-kept.png"))
    return out


def plot_kept(data: dict[str, Any], png: Path, genre: str | None = None) -> Path | None:
    """Small multiples: the kept-position histogram of each policy at the first budget of the plan."""
    results = data["results"]
    summary = results["summary"]
    genre = genre or summary["genres"][-1]
    first = next((c for c in summary["comparisons"] if c["kind"] == "budget"), summary["comparisons"][0])
    items = [
        i
        for i in first["genres"][genre]
        if i.get("cell") and summary["rows"][genre][i["cell"]]["kept_histogram"]
    ]
    if not items:
        return None
    cols = min(5, len(items))
    nrows = (len(items) + cols - 1) // cols
    figure, axes = figures.new_figure(width=2.4 * cols, height=1.9 * nrows + 0.4, ncols=1)
    axes[0].remove()
    grid = figure.subplots(nrows, cols, squeeze=False, sharey=True)
    for ax in grid.flat[len(items) :]:
        ax.remove()
    for ax, item in zip(grid.flat, items, strict=False):
        row = summary["rows"][genre][item["cell"]]
        hist = row["kept_histogram"]
        width = 1 / len(hist)
        ax.bar([i * width for i in range(len(hist))], hist, width=width, align="edge", color="C0")
        share = row["kept_prompt_share"]
        ax.set_title(
            f"{item['label']} K={item['budget']}\nprompt {100 * (share or 0):.0f}% of kept", fontsize=7
        )
        ax.tick_params(labelsize=6)
    figure.supxlabel("relative position of a kept token (0 = first prompt token, 1 = newest)", fontsize=8)
    figure.suptitle(f"where the kept tokens sit ({genre}, {first['kind']} {first['target']})", fontsize=9)
    return figures.save_figure(figure, png)
