"""The accuracy study's design (issue 41): which cells run, on what, and the two rules that chose
its numbers (the budgets from ``full``'s own traces, the problem count from a paired power formula).

A *cell* is one ``epikv eval`` run folder: one policy at one K on an arm's fixed, seeded subset
(``NAME:shuffle=SEED``, its first ``problems``), greedy, in one precision, under one length cap, in
the paper's chat prompt (the eval's default system message). Every cell runs on vLLM with the epikv
plugin in vLLM's default compiled mode (the engine that serves it), except the policies that read
attention rows, which vLLM's fused kernels never produce: those run on epikv's own engine, same
precision, same records. The noise cells repeat a main cell on the other engine, in vLLM's eager
mode, and in another batch size: how often the verdict on a problem changes with nothing but the
arithmetic is the floor every paired difference must beat.

Owns the design and the rules; it runs nothing (``cells.py``) and computes no statistic
(``summary.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from scipy.stats import norm

from epikv.eval.config import EvalConfig
from epikv.policies import policy_class

MODEL = "qwen2.5-coder-1.5b"
EPIKV_VARIANTS = ("epikv", "epikv-seg", "epikv-flat", "epikv-lag")
BASELINES = ("streaming", "h2o", "tova", "snapkv", "rkv", "keydiff", "random")
BLOCK = 32  # budgets are whole vLLM CPU blocks
_RANKED = re.compile(r"(?P<base>[^ ]+@K\d+) rho=(?P<rho>\d+)")  # a cell ranked every rho steps


@dataclass(frozen=True)
class Arm:
    """One dataset's part: its subset, cap, budgets (``budgets[0]`` is the main K) and policies.
    ``policies`` run at the main K; ``second`` at the other budgets; ``peak_policies`` at
    K = ``peak`` - their own interval, so that each holds at most what Seg-Q holds at the main K
    (equal peak memory: 192 + 128 = 320)."""

    name: str
    dataset: str
    problems: int
    max_new_tokens: int
    budgets: tuple[int, ...]
    policies: tuple[str, ...]
    second: tuple[str, ...] = ()
    peak: int | None = None
    peak_policies: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cell:
    """One run folder of the study. ``tag`` names a noise cell (its own subfolder); ``engine`` is
    the eval's (``vllm-compiled``, ``vllm`` = eager, ``epikv``); ``rank_every`` (rho, issue 56) a
    cell ranked every rho steps at tau = 1, named ``... rho=N`` with its own subfolder ``rhoN`` (a
    cell without it keeps the name and folder it always had)."""

    arm: str
    dataset: str
    policy: str
    budget: int | None
    engine: str
    problems: int
    max_new_tokens: int
    batch_size: int
    tag: str = ""
    rank_every: int | None = None

    @property
    def name(self) -> str:
        level = "full" if self.budget is None else f"K{self.budget}"
        rho = "" if self.rank_every is None else f" rho={self.rank_every}"
        return f"{self.arm}/{self.policy}@{level}{rho}" + (f" [{self.tag}]" if self.tag else "")

    def config(self, out: str, model: str, dtype: str, progress: bool = True) -> EvalConfig:
        folder = f"{out}/noise/{self.tag}" if self.tag else out
        folder += "" if self.rank_every is None else f"/rho{self.rank_every}"
        return EvalConfig(
            dataset=self.dataset, policy=self.policy, budget=self.budget, out=folder, model=model,
            limit=self.problems, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
            dtype=dtype, engine=self.engine, progress=progress, rank_every=self.rank_every,
        )  # fmt: skip


def interval(policy: str) -> int:
    """The policy's own compaction interval tau (its default)."""
    return int(policy_class(policy)().interval)


def reads_attention(policy: str) -> bool:
    """Whether ``policy`` ranks by attention rows (vLLM cannot run it: epikv's engine does)."""
    return policy_class(policy).reads_attention


EMULATED_BF16_HELP = "run a bf16 study on a CPU without bf16 matrix units anyway (several times slower)"


@dataclass(frozen=True)
class Study:
    """The whole study. ``batch_size``: prompts per vLLM ``generate`` call, all running at once
    (epikv's engine decodes ``engine_batch`` together). ``noise_problems``: the first problems of
    the GSM8K arm that the noise cells repeat. GSM8K's N = 512 is :func:`paired_sample_size` at the
    discordance measured on the first 64 common problems (``keydiff`` against ``full``: 10 of 64)
    for a 5-point difference, 80% power, alpha 0.05, rounded up to whole batches of 64."""

    model: str = MODEL
    dtype: str = "bfloat16"
    engine: str = "vllm-compiled"
    batch_size: int = 64
    engine_batch: int = 32
    arms: tuple[Arm, ...] = field(default_factory=lambda: DEFAULT_ARMS)
    noise_problems: int = 128
    budget_problems: int = 96  # the first problems of full whose traces the budget rule reads
    loop_min_span: int = 128  # a quarter of GSM8K's 512-token cap, an eighth of MATH-500's 1,024

    def cells(self) -> list[Cell]:
        """Every cell, in the order they are meant to run: each arm's ``full``, its main K, the
        second budgets, then the noise cells."""
        out: list[Cell] = []
        for arm in self.arms:
            out.append(self._cell(arm, "full", None))
            out += [self._cell(arm, p, arm.budgets[0]) for p in arm.policies if p != "full"]
            out += [self._cell(arm, p, k) for k in arm.budgets[1:] for p in arm.second]
            if arm.peak is not None:
                out += [self._cell(arm, p, arm.peak - interval(p)) for p in arm.peak_policies]
        out += self.noise_cells()
        return out

    def headline(self, arm: Arm) -> list[tuple[str, str]]:
        """The paper's headline comparisons on ``arm``, as pairs of cell names (declared
        2026-12-06, once the first cells had run): Seg-Q at the main K against ``full`` (does a
        budget keep the answers?), against H2O at the same K (the paper's comparison) and against
        H2O at Seg-Q's peak memory (K + tau). Each is tested on every problem both of its cells
        ran, so it can be read before every cell of its budget level is complete."""
        if not arm.budgets or "epikv" not in arm.policies:
            return []
        k = arm.budgets[0]
        segq = f"{arm.name}/epikv@K{k}"
        pairs = [(segq, f"{arm.name}/full@full")]
        if "h2o" in arm.policies:
            pairs.append((segq, f"{arm.name}/h2o@K{k}"))
        if arm.peak is not None and "h2o" in arm.peak_policies:
            pairs.append((segq, f"{arm.name}/h2o@K{arm.peak - interval('h2o')}"))
        return pairs

    def noise_cells(self) -> list[Cell]:
        """The first GSM8K cells again with nothing but the arithmetic changed: vLLM eager instead
        of compiled (``full``), epikv's engine instead of vLLM and another batch size (Seg-Q at the
        main K)."""
        arm = self.arms[0]
        n = min(self.noise_problems, arm.problems)
        k = arm.budgets[0]
        base = {"arm": arm.name, "dataset": arm.dataset, "problems": n, "max_new_tokens": arm.max_new_tokens}
        batch = self.engine_batch
        return [
            Cell(policy="full", budget=None, engine="vllm", batch_size=self.batch_size, tag="eager", **base),
            Cell(policy="epikv", budget=k, engine="epikv", batch_size=batch, tag="engine", **base),
            Cell(policy="epikv", budget=k, engine=self.engine, batch_size=16, tag="batch16", **base),
        ]  # fmt: skip

    def _cell(self, arm: Arm, policy: str, budget: int | None) -> Cell:
        on_engine = reads_attention(policy)
        return Cell(
            arm=arm.name, dataset=arm.dataset, policy=policy, budget=budget,
            engine="epikv" if on_engine else self.engine,
            batch_size=self.engine_batch if on_engine else self.batch_size,
            problems=arm.problems, max_new_tokens=arm.max_new_tokens,
        )  # fmt: skip

    def find(self, name: str) -> Cell:
        """A cell by name; ``NAME rho=N`` is the study's cell NAME ranked every N steps (its own
        folder), whether or not the study lists it."""
        cells = {c.name: c for c in self.cells()}
        if name in cells:
            return cells[name]
        ranked = _RANKED.fullmatch(name)
        if ranked is not None and ranked["base"] in cells and cells[ranked["base"]].budget is not None:
            return dataclasses.replace(cells[ranked["base"]], rank_every=int(ranked["rho"]))
        raise ValueError(
            f"no cell {name!r} in the study; cells: {', '.join(cells)} (each also as NAME rho=N)"
        )


def budgets_by_rule(totals: Sequence[int], fractions: Sequence[float] = (0.5, 0.75)) -> tuple[int, ...]:
    """The budgets rule: each fraction of the median (prompt + generated) tokens of ``full``,
    rounded to the nearest whole block of :data:`BLOCK` tokens."""
    if not totals:
        raise ValueError("no full-cache traces to choose budgets from")
    ordered = sorted(totals)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return tuple(max(BLOCK, round(f * median / BLOCK) * BLOCK) for f in fractions)


def paired_sample_size(discordance: float, delta: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Problems a paired comparison needs to tell an accuracy difference ``delta`` from none with
    a two-sided exact-McNemar-like test at ``alpha`` and the given power, when a fraction
    ``discordance`` of problems gets different verdicts (Connor 1987's normal approximation:
    n = (z_{1-alpha/2} sqrt(d) + z_power sqrt(d - delta^2))^2 / delta^2)."""
    if not 0 < delta**2 < discordance <= 1:
        raise ValueError(f"need 0 < delta^2 < discordance <= 1, got delta {delta}, discordance {discordance}")
    za, zb = norm.ppf(1 - alpha / 2), norm.ppf(power)
    return math.ceil((za * math.sqrt(discordance) + zb * math.sqrt(discordance - delta**2)) ** 2 / delta**2)


DEFAULT_ARMS = (
    Arm(
        name="gsm8k", dataset="gsm8k:shuffle=0", problems=512, max_new_tokens=512, budgets=(192, 288),
        policies=("full", *EPIKV_VARIANTS, *BASELINES), second=("epikv", "h2o", "streaming", "keydiff"),
        peak=320, peak_policies=("streaming", "keydiff", "h2o", "epikv-flat"),
    ),
    # MATH-500's budgets by the same rule, from its `full` cell's first 96 problems (median 564.5
    # tokens); its baselines chosen on GSM8K's first 128 (not on MATH-500): SnapKV and R-KV (tied
    # best at K = 192), H2O (the paper's comparison) and KeyDiff (best at equal peak, 320).
    Arm(
        name="math500", dataset="math500:shuffle=0", problems=200, max_new_tokens=1024, budgets=(288, 416),
        policies=("full", "epikv", "h2o", "snapkv", "rkv", "keydiff"), second=("epikv", "h2o"),
        peak=416, peak_policies=("h2o",),
    ),
)  # fmt: skip
