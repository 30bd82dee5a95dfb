"""``epikv bench goodput``: what a fixed KV pool buys, through vLLM (issue 56, part 3).

Each *cell* (``full``, or an evicting policy at one budget K, with the run's interval and
``rank_every``) submits the first ``problems`` problems of a task to vLLM at once, in one
``generate`` call, on a KV pool of ``pool_tokens`` tokens that every cell shares. vLLM admits what
the pool holds and queues the rest: ``full`` runs on plain vLLM (a request grows until the pool is
full, then vLLM preempts and later recomputes one), an evicting policy under the epikv plugin (each
request reserves what it can ever hold, at most K + tau, when it is admitted, and is never
preempted). The answers are graded as ``epikv eval`` grades them (its tasks, prompts, sampling and
grader); the figure of merit is correct answers per minute of the call's wall time.

The default pool (``pool_tokens`` None, :func:`default_pool_tokens`) is what 8 ``full`` requests at
the task's cap hold: 8 x the ``max_model_len`` the eval sizes its vLLM worker for, the longest prompt
of the problems plus ``max_new_tokens`` (the task's cap unless given) rounded up to whole blocks of
32 tokens. ``max_num_seqs`` is the number of problems, so only the pool limits how many run at once.

Each finished cell is kept as one JSON record in the parts folder (default ``OUT/goodput-parts``),
with a fingerprint of everything it was computed from; a rerun with the same config reuses it. The
figure (:func:`plot_goodput`) reads ``goodput.json`` alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from epikv.bench.goodput.engine import FULL, PoolGenerator
from epikv.bench.shared import documents, figures
from epikv.bench.shared.parts import Parts, fingerprint_of
from epikv.eval.generator import make_sampling
from epikv.eval.prompts import PAPER_SYSTEM_PROMPT, Messages, build_messages
from epikv.eval.tasks import Task, load_task
from epikv.eval.vllm_generator import BLOCK
from epikv.spec import parse_rank_every

POOL_REQUESTS = 8  # the default pool holds this many `full` requests at the task's cap
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class GoodputConfig:
    """Datasets x cells on one model. ``problems``: the first N problems of each dataset, all
    submitted at once. ``policies``: ``full`` (one cell) and evicting policies (one cell per budget).
    ``pool_tokens``: the KV pool of every cell, whole blocks of 32 (None: :func:`default_pool_tokens`
    per dataset). ``max_new_tokens`` None: the task's cap. ``eager``: vLLM without compilation (tests,
    quick runs; the default is vLLM's compiled mode). Sampling and the system prompt are the eval's."""

    model: str | None = None
    datasets: tuple[str, ...] = ("gsm8k",)
    problems: tuple[int, ...] = (64,)
    max_new_tokens: int | None = None
    policies: tuple[str, ...] = ("full", "keydiff", "epikv")
    budgets: tuple[int, ...] = (256,)
    interval: int | None = None
    rank_every: int | None = None
    pool_tokens: int | None = None
    dtype: str = "float32"
    eager: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    system_prompt: str = PAPER_SYSTEM_PROMPT
    vllm_python: str | None = None
    parts_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.datasets or len(self.problems) != len(self.datasets):
            raise ValueError(f"need one --problems count per dataset: {self.datasets} and {self.problems}")
        if min(self.problems) < 1:
            raise ValueError(f"problems must be >= 1, got {self.problems}")
        if not self.policies:
            raise ValueError("need some policies")
        if any(p != FULL for p in self.policies) and (not self.budgets or min(self.budgets) < 1):
            raise ValueError(f"evicting policies need budgets >= 1, got {self.budgets}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.pool_tokens is not None and (self.pool_tokens < BLOCK or self.pool_tokens % BLOCK):
            raise ValueError(f"pool_tokens must be whole blocks of {BLOCK} tokens, got {self.pool_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        object.__setattr__(self, "rank_every", parse_rank_every(self.rank_every, self.interval))


# A few minutes on 2 cores: 8 GSM8K problems, short answers, eager, `full` against one policy at a K
# that holds every prompt of the 8 with KeyDiff's window (the longest, 141 tokens, + 48).
QUICK = GoodputConfig(
    problems=(8,), max_new_tokens=256, policies=("full", "keydiff"), budgets=(192,), eager=True
)


@dataclass(frozen=True)
class Cell:
    """One run: ``full`` (budget, interval and rank_every None) or a policy at K = budget."""

    policy: str
    budget: int | None
    interval: int | None
    rank_every: int | None

    @property
    def name(self) -> str:
        if self.budget is None:
            return self.policy
        extra = "" if self.interval is None else f" tau={self.interval}"
        extra += "" if self.rank_every is None else f" rho={self.rank_every}"
        return f"{self.policy}@{self.budget}{extra}"


def cells(config: GoodputConfig) -> list[Cell]:
    """``full`` once, every other policy at each budget, in the order given."""
    out = []
    for policy in config.policies:
        if policy == FULL:
            out.append(Cell(FULL, None, None, None))
            continue
        out += [Cell(policy, k, config.interval, config.rank_every) for k in config.budgets]
    return out


def default_pool_tokens(longest_prompt: int, max_new_tokens: int, requests: int = POOL_REQUESTS) -> int:
    """What ``requests`` ``full`` requests at the cap hold: each the ``max_model_len`` the eval's
    vLLM worker is sized for, ``longest_prompt + max_new_tokens`` rounded up to whole blocks of 32."""
    return requests * (-(-(longest_prompt + max_new_tokens) // BLOCK) * BLOCK)


class CellGenerator(Protocol):
    """What a cell runs on (:class:`PoolGenerator`; a fake in tests)."""

    spec: Any
    stats: dict[str, Any]

    def prompt_ids(self, prompts: Sequence[Messages]) -> list[list[int]]: ...
    def size_pool(self, pool_tokens: int) -> None: ...
    def fit(self, prompts: list[Messages], /) -> Sequence[Any]: ...
    def __call__(self, prompts: list[Messages], sampling: Any, /) -> Sequence[Any]: ...
    def close(self) -> None: ...


GeneratorFactory = Callable[[GoodputConfig, Cell, int], CellGenerator]


def pool_generator(config: GoodputConfig, cell: Cell, max_new_tokens: int) -> CellGenerator:
    """The cell's vLLM client; ``max_num_seqs`` as large as any dataset's problems."""
    return PoolGenerator(
        config.model, cell.policy, cell.budget, cell.interval, rank_every=cell.rank_every,
        dtype=config.dtype, max_new_tokens=max_new_tokens, max_num_seqs=max(config.problems),
        eager=config.eager, python=config.vllm_python,
    )  # fmt: skip


def grade_cell(
    task: Task, cell: Cell, completions: Sequence[Any], stats: dict[str, Any], pool_tokens: int
) -> dict[str, Any]:
    """One row of ``goodput.json`` from the cell's completions (graded as the eval grades them) and
    the scheduler's statistics of its one ``generate`` call. The cache per request: the plugin's peak
    for an evicting policy, prompt + generated tokens for ``full``. ``interval``: the cell's asked
    one (:func:`run_cell` puts the resolved tau in its place)."""
    correct = sum(
        task.evaluate(example, c.text, cut=c.finish_reason == "length").correct
        for example, c in zip(task, completions, strict=True)
    )
    plain = cell.policy == FULL
    caches = [c.prompt_tokens + c.tokens_generated if plain else c.peak_cache_tokens for c in completions]
    wall = float(stats["wall_s"])
    generated = sum(c.tokens_generated for c in completions)
    return {
        "policy": cell.policy, "budget": cell.budget, "interval": cell.interval,
        "rank_every": cell.rank_every, "pool_tokens": pool_tokens, "problems": len(completions),
        "correct": correct, "accuracy": correct / len(completions), "wall_s": round(wall, 3),
        "correct_per_min": correct * 60.0 / wall if wall > 0 else None,
        "max_running": stats["max_running"], "mean_running": stats.get("mean_running"),
        "preemptions": stats["preemptions"],
        "mean_cache_per_request": sum(caches) / len(caches), "max_cache_per_request": max(caches),
        "generated_tokens": generated, "tokens_per_s": generated / wall if wall > 0 else None,
        "cap_hits": sum(c.finish_reason == "length" for c in completions),
        "errors": sum(c.finish_reason == "error" for c in completions), "steps": stats.get("steps"),
    }  # fmt: skip


def run_cell(
    config: GoodputConfig, task: Task, cell: Cell, generator: CellGenerator, max_new_tokens: int, pool: int
) -> dict[str, Any]:
    """Every problem of ``task`` at once on ``generator`` (its pool sized first), graded."""
    prompts = [build_messages(example.problem, config.system_prompt) for example in task]
    unfit = [(e.id, f.problem) for e, f in zip(task, generator.fit(prompts), strict=True) if f.problem]
    if unfit:
        raise ValueError(
            f"{cell.name}: {len(unfit)} prompts cannot run (first: {unfit[0][0]}: {unfit[0][1]})"
        )
    generator.size_pool(pool)
    sampling = make_sampling(
        max_new_tokens=max_new_tokens, temperature=config.temperature, top_p=config.top_p, seed=config.seed
    )
    completions = list(generator(prompts, sampling))
    row = grade_cell(task, cell, completions, generator.stats, pool)
    row["interval"] = generator.spec.interval if cell.budget is not None else None
    return {**row, "vllm": (getattr(generator, "started", None) or {}).get("vllm")}


def run_goodput(
    config: GoodputConfig,
    reporter: documents.Reporter | None = None,
    make_generator: GeneratorFactory = pool_generator,
) -> dict[str, Any]:
    """Every dataset x cell (finished ones read back from the parts folder): the document."""
    reporter = reporter or documents.Reporter()
    parts = Parts(config.parts_dir)
    rows = []
    for dataset, count in zip(config.datasets, config.problems, strict=True):
        task = load_task(dataset).slice(0, count)
        if len(task) < count:
            raise ValueError(f"dataset {dataset!r} has {len(task)} problems, fewer than {count}")
        cap = config.max_new_tokens or task.max_new_tokens
        pool = config.pool_tokens
        with reporter.bar(len(cells(config)), f"goodput {dataset}", unit="cell") as bar:
            for cell in cells(config):
                key = fingerprint_of(_settings(config), dataset, count, cap, cell.name)
                name = f"{dataset}-{cell.name}".replace(" ", "_")
                stored = parts.get(0, name, key)
                if stored is None:
                    started = time.perf_counter()
                    generator = make_generator(config, cell, cap)
                    try:
                        reporter.uses(generator.spec)
                        if pool is None:
                            prompts = [build_messages(e.problem, config.system_prompt) for e in task]
                            pool = default_pool_tokens(max(map(len, generator.prompt_ids(prompts))), cap)
                        row = run_cell(config, task, cell, generator, cap, pool)
                    finally:
                        generator.close()
                    stored = {"row": row, "spec": documents.spec_record(generator.spec)}
                    parts.put(0, name, key, stored, time.perf_counter() - started)
                else:
                    reporter.uses(stored["spec"])
                rows.append({"dataset": dataset, "max_new_tokens": cap, **stored["row"]})
                bar.update(1)
    return documents.make_document("goodput", config, {"rows": rows}, specs=reporter.specs)


def _settings(config: GoodputConfig) -> dict[str, Any]:
    """What a cell's result depends on, beyond the dataset and the cell: reuse needs all equal."""
    names = ("model", "pool_tokens", "dtype", "eager", "temperature", "top_p", "seed", "system_prompt")
    return {name: getattr(config, name) for name in names}


def plot_goodput(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Accuracy against correct answers per minute, one labelled point per cell (and dataset), from
    ``goodput.json`` alone."""
    document = documents.read_result(json_path, "goodput")
    rows = document["results"]["rows"]
    several = len({row["dataset"] for row in rows}) > 1
    figure, (axes,) = figures.new_figure()
    seen: dict[tuple[float, float], int] = {}  # labels of cells at one point stacked, not overprinted
    for row in rows:
        x, y = row["correct_per_min"] or 0.0, row["accuracy"]
        axes.scatter([x], [y], color="black" if row["policy"] == FULL else "tab:blue", zorder=3)
        label = _label(row) + (f" ({row['dataset']})" if several else "")
        above = seen.get((x, y), 0)
        seen[(x, y)] = above + 1
        axes.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4 + 11 * above), fontsize=8)
    axes.set_xlim(left=0.0)
    axes.set_ylim(-0.03, 1.03)
    pools = sorted({row["pool_tokens"] for row in rows})
    axes.set_xlabel("correct answers per minute")
    axes.set_ylabel("accuracy")
    axes.set_title(f"goodput at a KV pool of {', '.join(map(str, pools))} tokens", fontsize=10)
    axes.grid(alpha=0.3)
    return figures.save_figure(figure, png or figures.png_path(json_path))


def _label(row: dict[str, Any]) -> str:
    text = row["policy"] if row["budget"] is None else f"{row['policy']}@{row['budget']}"
    return text + ("" if row.get("rank_every") is None else f" rho={row['rank_every']}")
