"""The ρ-against-layer figure (the paper's Fig. 5), drawn from ``rho.json`` alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SIGNAL_NAMES = {"raw": "raw d", "mean": "rolling mean", "zscore": "rolling z-score"}


def plot_rho(rho_json: Path, out: Path) -> Path:
    """One panel per label kind: ρ of each signal against layer, with its bootstrap interval shaded,
    the chosen bands and the core's scaled default bands marked. Needs matplotlib (``epikv[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:
        raise ImportError("plotting needs matplotlib: pip install 'epikv[plot]'") from err
    data: dict[str, Any] = json.loads(Path(rho_json).read_text())
    kinds = list(data["labels"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.4 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for signal, curve in data["labels"][kind]["signals"].items():
            layers = range(len(curve["rho"]))
            (line,) = ax.plot(layers, curve["rho"], marker="o", ms=3, label=SIGNAL_NAMES.get(signal, signal))
            ax.fill_between(layers, curve["ci_low"], curve["ci_high"], color=line.get_color(), alpha=0.15)
        choice = data["choice"]
        if choice["label"] == kind:
            for band, style in (("band_a", "--"), ("band_b", ":")):
                ax.axvline(
                    choice[band], color="k", ls=style, lw=1, label=f"{band[-1].upper()} = {choice[band]}"
                )
            default = data.get("scaled_default", {})
            if default:
                a, b = default["band_a"]["layer"], default["band_b"]["layer"]
                ax.axvspan(
                    a - 0.15, a + 0.15, color="grey", alpha=0.3, label=f"scaled default A = {a}, B = {b}"
                )
                ax.axvspan(b - 0.15, b + 0.15, color="grey", alpha=0.3)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("layer")
        ax.set_ylabel("Spearman ρ")
        n = data["labels"][kind]
        ax.set_title(
            f"{data['model']} · {kind} labels · {data['n_problems']} problems, {n['n_tokens']} tokens"
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
