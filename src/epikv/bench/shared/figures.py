"""The Agg figure factory every benchmark's plots draw on; it knows no benchmark's figures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def new_figure(width: float = 6.4, height: float = 4.2, ncols: int = 1) -> tuple[Figure, list[Axes]]:
    """A matplotlib figure on the Agg canvas (no GUI backend, no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:
        raise ImportError("benchmark plots need matplotlib: pip install 'epikv[plot]'") from err
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, ncols)
    return figure, list(axes) if ncols > 1 else [axes]


def save_figure(figure: Figure, path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


def png_path(json_path: str | os.PathLike[str]) -> Path:
    return Path(json_path).with_suffix(".png")
