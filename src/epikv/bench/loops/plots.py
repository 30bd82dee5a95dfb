"""Figures of the loop study, drawn from its result document alone.

``plot_document`` writes one figure for the pooled problems (or the only dataset): a row of panels
per equal-peak level, each ranking the cells by loop rate with Wilson intervals and the full cache's
interval shaded, then cap-hit rate and accuracy in the same row order, then the memory view; and, when
the study swept K, a last row with the loop rate of each swept policy against K.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epikv.bench.loops.summary import FULL
from epikv.bench.shared import documents, figures
from epikv.bench.shared.ci_plots import Ranked, memory_panel, rank, ranked_panel

PANELS = (("loop", "loop rate"), ("cap_hit", "cap-hit rate"), ("correct", "accuracy"))


def _ranked(label: str, rate: dict[str, Any] | None) -> Ranked:
    if rate is None:
        return Ranked(label, None, None, None)
    return Ranked(label, rate["rate"], rate["low"], rate["high"])


def _shown(label: str, row: dict[str, Any]) -> str:
    """A row's label, with its problem count when the budget could not hold some prompts."""
    return f"{label} (n={row['problems']})" if row["skipped"] else label


def plot_document(json_path: str | Path, png: str | Path | None = None) -> Path:
    data = documents.read_result(json_path, "loops")
    summary = data["results"]["summary"]
    if not summary["datasets"]:  # a shard's document before another shard finished its cells
        raise ValueError(
            f"{json_path}: no batch has every cell yet, so there is nothing to plot; the parts are kept: "
            "run the same command without --shard to assemble them"
        )
    dataset = summary["datasets"][-1]  # "all" when there are several
    rows = summary["rows"][dataset]
    levels = [c for c in summary["comparisons"] if c["kind"] == "peak"]
    sweep = [c for c in summary["comparisons"] if c["kind"] == "sweep"]
    nrows = len(levels) + (1 if sweep else 0)
    ncols = len(PANELS) + 1
    figure, axes = figures.new_figure(width=3.0 * ncols, height=0.35 * 12 * nrows + 0.8, ncols=1)
    axes[0].remove()
    grid = figure.subplots(nrows, ncols, squeeze=False)
    for r, level in enumerate(levels):
        items = [i for i in level["datasets"][dataset] if i.get("cell")]
        cells = {_shown(i["label"], rows[i["cell"]]): i["cell"] for i in items}
        order = [row.label for row in rank([_ranked(k, rows[c]["loop"]) for k, c in cells.items()], False)]
        for c, (key, name) in enumerate(PANELS):
            ranked = [_ranked(label, rows[cells[label]][key]) for label in order]
            reference = _ranked(FULL, rows[FULL][key]) if FULL in rows else None
            ranked_panel(grid[r][c], ranked, reference, name, labels=c == 0)
        grid[r][0].set_title(f"equal peak memory {level['target']} tokens", fontsize=8, loc="left")
        memory_panel(
            grid[r][-1],
            order,
            [rows[cells[label]]["mean_cache_tokens"] for label in order],
            [rows[cells[label]]["peak_cache_tokens"] for label in order],
        )
    if sweep:
        _sweep_row(grid[-1], summary, dataset)
    n = rows[FULL]["problems"] if FULL in rows else "?"
    cfg = data["config"]
    figure.suptitle(
        f"{data['results']['model']}: {dataset}, {n} problems, greedy, cap {cfg['max_new_tokens']} tokens "
        f"(grey: the full cache's 95% interval)",
        fontsize=9,
    )
    return figures.save_figure(figure, png or figures.png_path(json_path))


def _sweep_row(axes: Any, summary: dict[str, Any], dataset: str) -> None:
    """Loop rate (and cap-hit rate) against K for each swept policy, every K it ran at."""
    rows = summary["rows"][dataset]
    labels = list(dict.fromkeys(i["label"] for c in summary["comparisons"] if c["kind"] == "sweep"
                                for i in c["datasets"][dataset]))  # fmt: skip
    for ax, (key, name) in zip(axes, PANELS, strict=False):
        for index, label in enumerate(labels):
            points = sorted(
                {
                    (i["budget"], i["cell"])
                    for c in summary["comparisons"]
                    for i in c["datasets"][dataset]
                    if i["label"] == label and i.get("cell") and rows[i["cell"]][key]
                }
            )
            if not points:
                continue
            found = [rows[cell][key] for _, cell in points]
            ks = [k for k, _ in points]
            err = [[f["rate"] - f["low"] for f in found], [f["high"] - f["rate"] for f in found]]
            ax.errorbar(ks, [f["rate"] for f in found], yerr=err, fmt="o-", color=f"C{index}", ms=3,
                        capsize=2, label=label)  # fmt: skip
        if FULL in rows and rows[FULL][key]:
            ax.axhspan(rows[FULL][key]["low"], rows[FULL][key]["high"], color="0.88", zorder=0, label=FULL)
        ax.set_xlabel("K (tokens kept)", fontsize=8)
        ax.set_ylabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    axes[0].set_title("larger-K sweep", fontsize=8, loc="left")
    axes[-1].remove()
