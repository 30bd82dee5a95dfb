"""The accuracy study's tables (markdown) and figure (accuracy against K), from ``summary.json``'s
dict alone: what the results page quotes, redrawn without a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epikv.bench.accuracy.design import Study


def _pct(rate: dict[str, Any] | None, ci: bool = False) -> str:
    if rate is None:
        return "–"
    text = f"{100 * rate['rate']:.1f}"
    if ci:
        low, high = rate["ci95"]
        text += f" [{100 * low:.1f}, {100 * high:.1f}]"
    return text


def _p(value: float) -> str:
    return f"{value:.2g}" if value >= 0.001 else f"{value:.1e}"


def cells_table(cells: dict[str, Any]) -> list[str]:
    lines = [
        "| cell | engine | τ | done / of | skipped | accuracy % [95% CI] | cap-hit % "
        "| loops % (exact / near) | evicted % | mean tokens | mean peak cache | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in cells.items():
        if not row["done"] and not row["skipped"]:
            continue
        lines.append(
            f"| {name} | {row['engine']} | {row['tau'] if row['tau'] is not None else '–'} | "
            f"{row['done']} / {row['of']} | {row['skipped']} | {_pct(row['correct'], True)} | "
            f"{_pct(row['cap_hit'])} | {_pct(row['loop'])} / {_pct(row['near_loop'])} | "
            f"{_pct(row['evicted'])} | {_num(row['mean_tokens'])} | "
            f"{_num(row['mean_peak_cache'])} | {_num(row['tokens_per_s'], '.1f')} |"
        )
    return lines


def _num(value: float | None, spec: str = ".0f") -> str:
    """A mean, or a dash for a cell with nothing generated yet (only skips so far)."""
    return "–" if value is None else format(value, spec)


def level_tables(title: str, level: dict[str, Any]) -> list[str]:
    lines = [f"### {title}", "", f"{level['n']} problems common to every cell here"]
    if level["excluded"]:
        lines[-1] += (
            f"; excluded for all (a prompt some policy cannot protect): {', '.join(level['excluded'])}"
        )
    lines[-1] += "."
    if not level["n"]:
        return [*lines, ""]
    lines += ["", f"Against `full` ({level['vs_full']['family']}):", ""]
    lines += ["| cell | accuracy % | Δ vs full (points) | full only / cell only | p | p (Holm) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for test in level["vs_full"]["tests"]:
        acc = level["accuracy"][test["a"]]
        lines.append(
            f"| {test['a']} | {_pct(acc, True)} | {100 * test['difference']:+.1f} | {test['b_only']} / "
            f"{test['a_only']} | {_p(test['p'])} | {_p(test['p_holm'])} |"
        )
    lines += [
        "",
        "Lost accuracy (problems `full` solves and the cell does not) and what those generations did:",
        "",
    ]
    lines += _lost_table(level["lost"])
    for key in ("pairs", "loops"):
        block = level[key]
        shown = [t for t in block["tests"] if t["p_holm"] < 0.05]
        lines += ["", f"{block['family']}: {len(shown)} of {len(block['tests'])} at p (Holm) < 0.05"]
        for t in shown:
            lines.append(
                f"- {t['a']} vs {t['b']}: {t['a_only']} / {t['b_only']} problems "
                f"(Δ {100 * t['difference']:+.1f} points), p (Holm) {_p(t['p_holm'])}"
            )
    return [*lines, ""]


def headline_table(block: dict[str, Any]) -> list[str]:
    lines = [f"### Headline comparisons ({block['family']})", "",
             "| cell | against | problems | accuracy % | against: accuracy % | cell only / against only "
             "| p | p (Holm) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for t in block["tests"]:
        lines.append(
            f"| {t['a']} | {t['b']} | {t['n']} | {_pct(t['accuracy'][t['a']], True)} | "
            f"{_pct(t['accuracy'][t['b']], True)} | {t['a_only']} / {t['b_only']} | {_p(t['p'])} | "
            f"{_p(t['p_holm'])} |"
        )
    lines += ["", "What the answers each of these cells loses against `full` did (on the problems both ran):"]
    return [*lines, "", *_lost_table(block["lost"], problems=True), ""]


def _lost_table(rows: dict[str, Any], problems: bool = False) -> list[str]:
    """Lost answers against ``full`` and what those generations did, a row per cell (``problems``:
    a column for the problems each row is on, where rows differ)."""
    extra = ("| problems ", "|---") if problems else ("", "")
    head = "| lost | gained | of lost: exact loop | near loop | cap hit | near loop or cap |"
    lines = [f"| cell {extra[0]}{head}", f"|---{extra[1]}|---|---|---|---|---|---|"]
    for name, row in rows.items():
        n = f"| {row['n']} " if problems else ""
        lines.append(
            f"| {name} {n}| {row['lost']} | {row['gained']} | {row['loop']} | {row['near_loop']} | "
            f"{row['cap_hit']} | {row['loop_or_cap']} |"
        )
    return lines


def noise_table(noise: dict[str, Any]) -> list[str]:
    lines = ["| noise cell | against | problems | verdict changed % [95% CI] | identical token streams |",
             "|---|---|---|---|---|"]  # fmt: skip
    for tag, row in noise.items():
        if not row["n"]:
            lines.append(f"| {tag} | {row['against']} | 0 | – | – |")
            continue
        lines.append(
            f"| {tag} | {row['against']} | {row['n']} | {_pct(row['verdict_changed'], True)} | "
            f"{row['identical_tokens']} of {row['n']} |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Accuracy study: tables (written by `epikv bench accuracy summarize`)", "", "## Cells", ""]
    lines += cells_table(result["cells"])
    for arm, data in result["arms"].items():
        lines += ["", f"## {arm}", ""]
        rule = data.get("budget_rule")
        if rule:
            lines.append(
                f"Budgets: the rule (half and three quarters of `full`'s median prompt + generated tokens on "
                f"its first {rule['from_problems']} problems, in blocks of 32) gives {rule['rule']}; "
                f"the study runs {rule['chosen']}."
            )
            lines.append("")
        if data.get("headline"):
            lines += headline_table(data["headline"])
        readings = [(f"{arm} at K = {k}", level) for k, level in data["levels"].items()]
        peaks = data["equal_peak"].items()
        readings += [(f"{arm} at equal peak memory K + τ = {p}", level) for p, level in peaks]
        for title, level in readings:
            lines += level_tables(title, level)
            if "whole" in level:
                lines += level_tables(f"{title}, only the cells with every problem", level["whole"])
    lines += ["", "## Noise floor", "", *noise_table(result["noise"])]
    return "\n".join(lines) + "\n"


_MARKERS = "os^Dv<>PXph*"


def policy_styles(policies: list[str]) -> dict[str, tuple[int, str]]:
    """Each policy's (tab20 colour index, marker), the same in every panel: strong shades first, then
    light, so up to 20 policies get 20 colours, and the marker differs between neighbours too."""
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    names = sorted(set(policies))
    return {name: (order[i % 20], _MARKERS[i % len(_MARKERS)]) for i, name in enumerate(names)}


def plot(result: dict[str, Any], study: Study, path: Path) -> Path:
    """Accuracy against K per policy (Wilson intervals), ``full`` as a band, one panel per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in study.arms if result["arms"].get(a.name, {}).get("levels")]
    styles = policy_styles([r["policy"] for r in result["cells"].values() if r["budget"] is not None])
    palette = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, max(1, len(arms)), figsize=(6.5 * max(1, len(arms)), 4.5), squeeze=False)
    for ax, arm in zip(axes[0], arms, strict=False):
        rows = [r for r in result["cells"].values() if r["cell"].startswith(f"{arm.name}/") and r["correct"]]
        full = next((r for r in rows if r["policy"] == "full" and "[" not in r["cell"]), None)
        if full:
            low, high = full["correct"]["ci95"]
            ax.axhspan(100 * low, 100 * high, color="0.85", label=f"full {_pct(full['correct'])}%")
        for policy in sorted({r["policy"] for r in rows if r["budget"] is not None}):
            mine = sorted((r for r in rows if r["policy"] == policy and "[" not in r["cell"]),
                          key=lambda r: r["budget"])  # fmt: skip
            ks = [r["budget"] for r in mine]
            acc = [100 * r["correct"]["rate"] for r in mine]
            err = [[a - 100 * r["correct"]["ci95"][0] for a, r in zip(acc, mine, strict=True)],
                   [100 * r["correct"]["ci95"][1] - a for a, r in zip(acc, mine, strict=True)]]  # fmt: skip
            colour, marker = styles[policy]
            ax.errorbar(ks, acc, yerr=err, marker=marker, color=palette(colour), capsize=3, label=policy)
        ax.set(title=f"{arm.name} ({study.model}, {study.dtype}, greedy)", xlabel="budget K (tokens)",
               ylabel="accuracy % (95% Wilson)")  # fmt: skip
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
