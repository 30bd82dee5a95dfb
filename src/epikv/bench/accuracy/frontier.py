"""The frontier study's design (issue 56): which configurations hold the same peak memory, what each
costs, and which of them keep the answers, on the accuracy study's model, problems, prompt and cap.

Two equal-peak levels, the two the accuracy study has: 193 tokens (K = 192 at tau = 1) and 320 (K =
319 at tau = 1; Seg-Q at K = 192 with tau = 128). At each level:

- **new cells** (this study's folder, ``results/frontier``): Seg-Q (``epikv``) ranked every rho = 32
  and 128 steps at tau = 1; KeyDiff and SnapKV ranked every 128 steps; the two equal-memory baselines
  of arXiv 2609.03430 (``streaming-prompt``: the prompt and the newest tokens; ``random-head``: random
  eviction drawn per KV head, prompt kept). A cell ranked every rho steps holds at most K + 1.
- **reused cells** (the accuracy study's records, ``results/accuracy``, where a configuration is
  identical): ``full``; KeyDiff at tau = 1 (K = 192 and 319); Seg-Q at tau = 128 and K = 192 (peak 320).

Problems: the study's GSM8K subset (``gsm8k:shuffle=0``), the first :attr:`Frontier.problems` = 256;
every pair is read on the problems both cells ran (the reused cells have 512). Declared before any
new cell runs (2026-12-07): the pairs that decide the issue's target, each Seg-Q configuration at
peak 320 against KeyDiff@319, are extended to the first 512 problems (the new cell's
:attr:`Frontier.extended`) where the first 256 leave them undecided, that is, Holm-adjusted p >=
0.05 within the level. Statistics are the accuracy study's (:func:`epikv.bench.accuracy.summary.level`:
exact McNemar per pair, Holm per family within the level).

Owns the design and the extension rule; it runs nothing (``cells.py``) and computes no statistic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from epikv.bench.accuracy.design import Cell, Study

LEVELS = (193, 320)
RANKED = (("epikv", 32), ("epikv", 128), ("keydiff", 128), ("snapkv", 128))
"""(policy, rho) of the new cells ranked every rho steps at tau = 1."""
BASELINES = ("streaming-prompt", "random-head")
"""The equal-memory protocol's baselines (tau = 1, no ranking)."""
HOME = {"frontier": "results/frontier", "accuracy": "results/accuracy"}


@dataclass(frozen=True)
class FrontierCell:
    """A cell at one equal-peak ``level``; ``home`` says whose folder holds its records: ``frontier``
    (a new cell) or ``accuracy`` (the accuracy study's, reused)."""

    level: int
    cell: Cell
    home: str

    @property
    def name(self) -> str:
        return self.cell.name


@dataclass(frozen=True)
class Frontier:
    """The whole frontier. ``problems``: the new cells' first problems; ``extended``: the problems a
    pair left undecided runs to (see the module docstring)."""

    study: Study = field(default_factory=Study)
    arm: str = "gsm8k"
    levels: tuple[int, ...] = LEVELS
    problems: int = 256
    extended: int = 512

    def cells(self) -> list[FrontierCell]:
        """Every cell, in the order they are meant to run: per level, the new cells (the cheap
        baselines first), then the reused ones."""
        out: list[FrontierCell] = []
        for level in self.levels:
            k = level - 1  # tau = 1: at most K + 1 held
            new = [self._new(p, k, None) for p in BASELINES] + [self._new(p, k, rho) for p, rho in RANKED]
            out += [FrontierCell(level, c, "frontier") for c in new]
            out += [FrontierCell(level, c, "accuracy") for c in self._reused(level)]
        return out

    def full(self) -> Cell:
        return self.study.find(f"{self.arm}/full@full")

    def find(self, name: str) -> FrontierCell:
        found = {c.name: c for c in self.cells()}
        if name not in found:
            raise ValueError(f"no cell {name!r} in the frontier; cells: {', '.join(found)}")
        return found[name]

    def target_pairs(self, level: int) -> list[tuple[str, str]]:
        """The pairs the issue's target reads, declared: at peak 320, each Seg-Q configuration
        against KeyDiff@319 (tau = 1); none at other levels."""
        if level != 320:
            return []
        keydiff = f"{self.arm}/keydiff@K319"
        segq = [c.name for c in self.cells() if c.level == level and c.cell.policy == "epikv"]
        return [(name, keydiff) for name in segq]

    def to_extend(self, level: int, tests: list[dict[str, Any]]) -> list[str]:
        """The new cells to run on to :attr:`extended` problems: those of a target pair whose test
        (a row of the level's ``pairs`` family, with ``p_holm``) is undecided (p_holm >= 0.05) and
        that still hold fewer than :attr:`extended` problems."""
        undecided = {(t["a"], t["b"]) for t in tests if t["p_holm"] >= 0.05}
        undecided |= {(b, a) for a, b in undecided}
        homes = {c.name: c for c in self.cells() if c.level == level}
        out = []
        for a, b in self.target_pairs(level):
            if (a, b) in undecided:
                out += [
                    n
                    for n in (a, b)
                    if homes[n].home == "frontier" and homes[n].cell.problems < self.extended
                ]
        return out

    def extend(self, cell: FrontierCell) -> FrontierCell:
        """``cell`` on :attr:`extended` problems (its folder resumes where the first ones stopped)."""
        return dataclasses.replace(cell, cell=dataclasses.replace(cell.cell, problems=self.extended))

    def _new(self, policy: str, k: int, rho: int | None) -> Cell:
        cell = self.study._cell(self._arm(), policy, k)
        return dataclasses.replace(cell, problems=self.problems, rank_every=rho)

    def _reused(self, level: int) -> list[Cell]:
        names = [f"{self.arm}/keydiff@K{level - 1}"]
        if level == 320:
            names.append(f"{self.arm}/epikv@K192")  # Seg-Q at tau = 128: peak 192 + 128
        return [self.study.find(n) for n in names]

    def _arm(self) -> Any:
        return next(a for a in self.study.arms if a.name == self.arm)
