"""Figures drawn from finished runs only (no model, no live state).

Per dataset: accuracy vs budget per policy (paper Fig. 3), accuracy vs seconds per problem
(Fig. 4) and cap-hit rate vs budget. Full-cache runs (budget None) have no x position on a budget
axis, so they appear there as dashed horizontal reference lines. Uses matplotlib's object API
with the Agg canvas, so no GUI backend or global pyplot state is touched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from epikv.eval.runs import RunSummary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _new_figure() -> tuple[Figure, Axes]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:
        raise ImportError("plots need matplotlib: pip install 'epikv[plot]'") from err
    figure = Figure(figsize=(6.0, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _by_policy(runs: Sequence[RunSummary]) -> dict[str, list[RunSummary]]:
    grouped: dict[str, list[RunSummary]] = defaultdict(list)
    for run in runs:
        grouped[run.policy].append(run)
    return dict(sorted(grouped.items()))


def _versus_budget(runs: Sequence[RunSummary], metric: str, ylabel: str, title: str, path: Path) -> Path:
    budget_figure(runs, metric, ylabel, title).savefig(path, dpi=120)
    return path


def budget_figure(runs: Sequence[RunSummary], metric: str, ylabel: str, title: str) -> Figure:
    """``metric`` (a rate) against the budget, one line per policy; a run without a budget (the full
    cache) is a dashed horizontal reference line, never a point at some K."""
    figure, axes = _new_figure()
    for index, (policy, group) in enumerate(_by_policy(runs).items()):
        colour = f"C{index % 10}"
        budgeted = sorted((r for r in group if r.budget is not None), key=lambda r: r.budget or 0)
        xs = [r.budget for r in budgeted]
        ys = [100 * (r.summary[metric] or 0.0) for r in budgeted]
        if budgeted and metric == "accuracy":
            lows = [y - 100 * r.summary["accuracy_ci95"][0] for y, r in zip(ys, budgeted, strict=True)]
            highs = [100 * r.summary["accuracy_ci95"][1] - y for y, r in zip(ys, budgeted, strict=True)]
            axes.errorbar(xs, ys, yerr=[lows, highs], marker="o", capsize=3, color=colour, label=policy)
        elif budgeted:
            axes.plot(xs, ys, marker="o", color=colour, label=policy)
        for full in (r for r in group if r.budget is None):
            value = 100 * (full.summary[metric] or 0.0)
            label = policy if "full" in policy else f"{policy} (full cache)"
            axes.axhline(value, linestyle="--", color=colour, label=label)
    budgets = sorted({r.budget for r in runs if r.budget is not None})
    if budgets:
        axes.set_xscale("log", base=2)
        axes.set_xticks(budgets, [str(b) for b in budgets])
        axes.minorticks_off()
    axes.set_xlabel("KV budget (tokens)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize="small")
    return figure


def _accuracy_versus_time(runs: Sequence[RunSummary], title: str, path: Path) -> Path:
    figure, axes = _new_figure()
    for index, (policy, group) in enumerate(_by_policy(runs).items()):
        points = [r for r in group if r.summary["seconds_per_problem"] is not None]
        xs = [r.summary["seconds_per_problem"] for r in points]
        ys = [100 * (r.summary["accuracy"] or 0.0) for r in points]
        axes.scatter(xs, ys, color=f"C{index % 10}", label=policy)
        for x, y, run in zip(xs, ys, points, strict=True):
            axes.annotate(run.budget_label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    axes.set_xlabel("wall seconds per problem")
    axes.set_ylabel("accuracy (%)")
    axes.set_title(title)
    axes.legend(fontsize="small")
    figure.savefig(path, dpi=120)
    return path


def draw_all(runs: Sequence[RunSummary], out_dir: Path) -> list[Path]:
    """Writes the three figures per dataset into `out_dir`; returns the PNG paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    datasets: dict[str, list[RunSummary]] = defaultdict(list)
    for run in runs:
        datasets[run.dataset].append(run)
    written = []
    for dataset, group in sorted(datasets.items()):
        written += [
            _versus_budget(
                group,
                "accuracy",
                "accuracy (%)",
                f"{dataset}: accuracy vs budget",
                out_dir / f"accuracy_vs_budget_{dataset}.png",
            ),
            _accuracy_versus_time(
                group, f"{dataset}: accuracy vs time", out_dir / f"accuracy_vs_seconds_{dataset}.png"
            ),
            _versus_budget(
                group,
                "cap_hit_rate",
                "cap-hit rate (%)",
                f"{dataset}: generations hitting the cap",
                out_dir / f"cap_hit_vs_budget_{dataset}.png",
            ),
        ]
    return written
