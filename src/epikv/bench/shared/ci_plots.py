"""Panels that rank cells by one interval and show the memory each holds (issue 18, item 3).

A *ranked interval panel* draws one row per cell, best at the top: the point estimate with its
interval, and the reference cell's interval shaded across the panel, so a reader sees at once which
cells are outside it. The *memory panel* beside it keeps the same rows: mean cached tokens (bar) and
peak (tick). Used by the fidelity and loop studies' figures; it knows nothing of either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class Ranked(NamedTuple):
    """One row: a label and its estimate with interval (None: the cell has no value)."""

    label: str
    value: float | None
    low: float | None
    high: float | None


def rank(rows: Sequence[Ranked], higher_is_better: bool) -> list[Ranked]:
    """Best first; rows without a value last, in their given order."""
    valued = [r for r in rows if r.value is not None]
    valued.sort(key=lambda r: r.value, reverse=higher_is_better)  # type: ignore[arg-type, return-value]
    return valued + [r for r in rows if r.value is None]


def short(label: str, width: int = 22) -> str:
    """A policy variant ``name:key=value:...`` wrapped onto lines of about ``width`` characters, so
    a long variant does not squeeze its panel."""
    import textwrap

    name, *params = label.split(":")
    return "\n".join([name, *textwrap.wrap(",".join(params), width)]) if params else name


def ranked_panel(
    ax: Any,
    rows: Sequence[Ranked],
    reference: Ranked | None,
    xlabel: str,
    labels: bool = True,
) -> None:
    """Rows drawn top to bottom in the order given; the reference's interval shaded grey."""
    y = list(range(len(rows)))[::-1]
    if reference is not None and reference.low is not None:
        ax.axvspan(reference.low, reference.high, color="0.88", zorder=0, label=f"{reference.label} 95% CI")
    for pos, row in zip(y, rows, strict=True):
        if row.value is None:
            continue
        is_ref = reference is not None and row.label == reference.label
        err = [[row.value - row.low], [row.high - row.value]]
        ax.errorbar(row.value, pos, xerr=err, fmt="o", color="0.3" if is_ref else "C0", ms=4, capsize=2)
    ax.set_yticks(y)
    ax.set_yticklabels([short(r.label) for r in rows] if labels else [], fontsize=6)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", color="0.92")


def memory_panel(
    ax: Any, labels: Sequence[str], means: Sequence[float | None], peaks: Sequence[float | None]
) -> None:
    """Mean cached tokens (bars) and the peak (ticks), rows in the order given (same as a ranked
    panel beside it)."""
    y = list(range(len(labels)))[::-1]
    ax.barh(y, [m or 0 for m in means], color="C2", alpha=0.6, height=0.6, label="mean cached")
    peak_rows = [(p, pos) for p, pos in zip(peaks, y, strict=True) if p is not None]
    if peak_rows:
        ax.plot([p for p, _ in peak_rows], [pos for _, pos in peak_rows], "|", color="k", ms=9, label="peak")
    ax.set_yticks(y)
    ax.set_yticklabels([])
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.set_xlabel("cached tokens per sequence", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=6, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
