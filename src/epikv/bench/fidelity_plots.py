"""Figures of the fidelity study, drawn from its result document alone.

``plot_document`` writes the main figure (per genre: top-1 agreement over the common tail window
against the mean cached tokens, one line per policy through its budgets, 95% intervals) and, beside
it, ``<name>-kept.png``: where each policy's kept tokens sit (kept-position histograms pooled over
compactions, layers, heads and prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epikv.bench import documents, figures


def _cells_of(results: dict[str, Any]) -> dict[str, list[tuple[int, str]]]:
    """label -> [(budget, cell)] in budget order."""
    found: dict[str, set[tuple[int, str]]] = {}
    for entry in results["plan"]:
        if entry.get("cell"):
            found.setdefault(entry["label"], set()).add((entry["budget"], entry["cell"]))
    return {label: sorted(cells) for label, cells in found.items()}


def plot_document(
    json_path: str | Path, png: str | Path | None = None, metric: str = "agreement_tail"
) -> Path:
    data = documents.read_result(json_path, "fidelity")
    results = data["results"]
    summary, cells = results["summary"], _cells_of(results)
    genres = summary["genres"]
    figure, axes = figures.new_figure(width=4.0 * len(genres), height=4.2, ncols=len(genres))
    for panel, genre in zip(axes, genres, strict=True):
        rows = summary["rows"][genre]
        for index, (label, chosen) in enumerate(cells.items()):
            points = [(rows[c]["mean_cache_tokens"], rows[c][metric]) for _, c in chosen if rows[c][metric]]
            points = [(x, y) for x, y in points if x is not None]
            if not points:
                continue
            xs = [x for x, _ in points]
            ys = [y[0] for _, y in points]
            err = [[y[0] - y[1] for _, y in points], [y[2] - y[0] for _, y in points]]
            style = "-" if index < 10 else "--"
            panel.errorbar(
                xs, ys, yerr=err, fmt="o" + style, color=f"C{index % 10}", ms=3, lw=1, capsize=2, label=label
            )
        panel.set_title(f"{genre} ({summary['full'][genre]['prompts']} prompts)", fontsize=9)
        panel.set_xlabel("mean cached tokens")
    axes[0].set_ylabel(f"{metric.replace('_', ' ')} with the full cache")
    axes[-1].legend(fontsize=6, loc="lower right")
    cfg = data["config"]
    figure.suptitle(
        f"{results['model']}: T={cfg['trace_tokens']}, tail = last {cfg['tail_tokens']} tokens", fontsize=9
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
