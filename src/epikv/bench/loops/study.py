"""``epikv bench loops``: does eviction make the model loop? Free-running greedy generation on
GSM8K and MATH-500 under every policy at equal peak memory (issue 18).

Each *cell* (a policy variant at one K) generates every problem greedily in the paper's chat
protocol, up to a cap, in one engine run that decodes ``batch_size`` problems together and admits
the next as soon as one finishes (:mod:`epikv.bench.loops.runs`). ``full`` is always a cell: every
other cell's divergence is measured from its trace. The levels are peaks (each policy at
K = peak - tau, :func:`epikv.spec.budget_at_peak`), plus a sweep of larger K for the policies that
rank by a fixed score. Each (batch of ``batch_size`` problems, cell) is kept in the parts store
(:mod:`epikv.bench.shared.parts`, as the fidelity study does) with the token ids, so a rerun computes only
what is missing and loop thresholds can change without a model. ``--shard I/N`` computes only every
N-th cell; ``--ray`` runs the N shards as Ray tasks on a shared parts folder, then the driver
assembles them. Statistics: :mod:`epikv.bench.loops.summary`; figures: :mod:`epikv.bench.loops.plots`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epikv.bench.fidelity.study import parse_variant
from epikv.bench.loops.runs import Problem, generate_cell, load_problems
from epikv.bench.loops.summary import FULL, SHIFT_LIMIT, problem_facts, shifted_cells, summarize_loops
from epikv.bench.shared import documents, machine, model_loading
from epikv.bench.shared.parts import Parts, cell_print, fingerprint_of
from epikv.eval.config import parse_shard
from epikv.eval.loops import LoopConfig, number_token_ids
from epikv.eval.prompts import PAPER_SYSTEM_PROMPT
from epikv.integration import build_spec
from epikv.policies import policy_class
from epikv.spec import CacheSpec, budget_at_peak, parse_policy_params, parse_rank_every

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("full", "streaming", "random", "h2o", "tova", "snapkv", "rkv", "epikv", "epikv-flat")


@dataclass(frozen=True)
class LoopsConfig:
    """Datasets x cells. ``problems``/``offsets``: per dataset (the defaults start past the GSM8K
    problems the calibration used, 0-39, and the MATH-500 ones the fidelity study used, <= 94).
    ``policies`` are names or variants ``name:key=value``; ``peaks`` give each evicting policy
    K = peak - tau; ``sweep_policies`` also run at each of ``sweep_budgets`` (equal K).
    ``references``: policies every cell is tested against, paired over problems. ``rank_every``
    (rho, issue 56): every evicting cell at tau = 1, ranking every rho steps (peak K + 1; its cells
    are named ``label@K rho=N``, apart from the cells without it). The loop detectors
    are the eval's, exact and near-periodic (``loop_*``: their :class:`~epikv.eval.loops.LoopConfig`).
    ``batch_size``: problems decoded together, and the problems a part keeps. ``shard`` I/N computes
    every N-th cell only; ``ray`` (an address, or ``local``) runs ``shards`` shards as Ray tasks."""

    model: str | None = None
    datasets: tuple[str, ...] = ("gsm8k", "math500")
    problems: tuple[int, ...] = (128, 64)
    offsets: tuple[int, ...] = (40, 95)
    max_new_tokens: int = 1024
    policies: tuple[str, ...] = DEFAULT_POLICIES
    peaks: tuple[int, ...] = (320, 448)
    sweep_policies: tuple[str, ...] = ("h2o", "epikv-flat")
    sweep_budgets: tuple[int, ...] = (640, 896)
    references: tuple[str, ...] = ("full", "h2o")
    interval: int | None = None
    attention: str = "recompute"
    system_prompt: str = PAPER_SYSTEM_PROMPT
    loop_min_span: int = LoopConfig.min_span
    loop_min_repeats: int = LoopConfig.min_repeats
    loop_max_period: int = LoopConfig.max_period
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    batch_size: int = 8
    parts_dir: str | None = None
    shard: str | None = None
    shards: int = 1
    ray: str | None = None
    rank_every: int | None = None

    def __post_init__(self) -> None:
        parse_rank_every(self.rank_every, self.interval)
        if not self.datasets or len(self.problems) != len(self.datasets):
            raise ValueError(f"need one --problems count per dataset: {self.datasets} and {self.problems}")
        if len(self.offsets) != len(self.datasets):
            raise ValueError(f"need one --offsets value per dataset: {self.datasets} and {self.offsets}")
        if min(self.problems) < 1 or min(self.offsets) < 0:
            raise ValueError(
                f"problems must be >= 1 and offsets >= 0, got {self.problems} and {self.offsets}"
            )
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shards < 1:
            raise ValueError(
                f"max_new_tokens, batch_size and shards must be >= 1, got "
                f"{self.max_new_tokens}, {self.batch_size}, {self.shards}"
            )
        if FULL not in self.policies:
            raise ValueError(f"policies must include {FULL!r}: divergence is measured from its trace")
        missing = [r for r in self.references if r not in self.policies]
        if missing:
            raise ValueError(f"references {missing} are not among the policies {list(self.policies)}")
        if not self.peaks and not self.sweep_budgets:
            raise ValueError("need some peaks (equal peak memory) or sweep budgets (equal K)")
        if min(self.peaks + self.sweep_budgets, default=1) < 1:
            raise ValueError(f"peaks and sweep budgets must be >= 1, got {self.peaks + self.sweep_budgets}")
        if self.ray is not None and self.shard is not None:
            raise ValueError("give --shard I/N (that one shard here) or --ray with --shards N, not both")
        if self.ray is not None and not self.parts_dir:
            raise ValueError("--ray needs a parts folder the workers share (parts_dir)")
        parse_shard(self.shard)
        self.loop_config()

    def loop_config(self) -> LoopConfig:
        return LoopConfig(self.loop_min_span, self.loop_min_repeats, self.loop_max_period)


# About two minutes on one core: two GSM8K problems, 64 new tokens, three cells.
QUICK = LoopsConfig(
    datasets=("gsm8k",),
    problems=(2,),
    offsets=(40,),
    max_new_tokens=64,
    policies=("full", "streaming", "h2o"),
    peaks=(128,),
    sweep_policies=(),
    sweep_budgets=(),
    references=("full",),
    loop_min_span=32,
)


def plan_cells(
    model: torch.nn.Module, config: LoopsConfig
) -> tuple[dict[str, CacheSpec], list[dict[str, Any]]]:
    """The specs of every cell (name -> spec, ``full`` first) and the plan: one entry per (variant,
    level), with its K or the reason no K can match the level."""
    specs: dict[str, CacheSpec] = {FULL: build_spec(model, FULL)}
    plan: list[dict[str, Any]] = []

    rho = config.rank_every
    tau = 1 if rho is not None else config.interval  # what an equal peak subtracts

    def add(label: str, kind: str, target: int, budget: int, params: dict[str, Any]) -> None:
        cell = f"{label}@{budget}" + ("" if rho is None else f" rho={rho}")
        plan.append({"label": label, "kind": kind, "target": target, "budget": budget, "cell": cell})
        if cell not in specs:
            specs[cell] = build_spec(
                model,
                parse_variant(label)[0],
                budget,
                interval=config.interval,
                attention=config.attention,
                params=params,
                rank_every=rho,
            )

    for peak in config.peaks:
        for label in config.policies:
            name, raw = parse_variant(label)
            if not policy_class(name).evicts:
                plan.append({"label": label, "kind": "peak", "target": peak, "budget": None, "cell": FULL})
                continue
            params = parse_policy_params(policy_class(name), raw)  # typed, as the eval parses them
            try:
                add(label, "peak", peak, budget_at_peak(name, peak, tau, params), raw)
            except ValueError as err:
                plan.append({"label": label, "kind": "peak", "target": peak, "budget": None, "why": str(err)})
    for label in config.sweep_policies:
        if not policy_class(parse_variant(label)[0]).evicts:
            raise ValueError(f"sweep policy {label!r} does not evict: a sweep over K means nothing for it")
    for budget in config.sweep_budgets:
        for label in config.sweep_policies:
            add(label, "sweep", budget, budget, parse_variant(label)[1])
    return specs, plan


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def run_loops(
    config: LoopsConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    reporter: documents.Reporter | None = None,
) -> dict[str, Any]:
    """Every problem x cell, finished parts (batches of ``batch_size`` problems) kept in
    ``parts_dir``; returns the document (per-problem facts, the summary, the plan, the cost). Each
    cell's missing batches are one engine run decoding ``batch_size`` problems at a time. With
    ``shard`` only that shard's cells are computed, and the summary counts the complete batches."""
    from epikv.generation import eos_ids

    reporter = reporter or documents.Reporter()
    if config.ray is not None:
        _run_on_ray(config)
    machine.set_threads(config.threads)
    if model is None:
        model, tokenizer = model_loading.load_bench_model(config.model, config.device, config.dtype)
    specs, plan = plan_cells(model, config)
    for spec in specs.values():
        reporter.uses(spec)
    stop = frozenset(eos_ids(model, tokenizer))
    settings = {
        "max_new_tokens": config.max_new_tokens,
        "stop": sorted(stop),
        "model": model_loading.model_name(model),
    }
    work = _batches(config, tokenizer)
    shard_index, shard_count = parse_shard(config.shard)
    loops, numbers = config.loop_config(), number_token_ids(tokenizer)
    started = time.perf_counter()
    stores = {dataset: _parts(config, dataset) for dataset in config.datasets}
    prints = [fingerprint_of([p.key for p in batch], settings) for _, _, batch in work]
    results = [
        {name: stores[d].get(b, name, cell_print(prints[g], spec)) for name, spec in specs.items()}
        for g, (d, b, _) in enumerate(work)
    ]
    bar = reporter.bar(len(work) * len(specs), "loops", unit="run")
    bar.update(sum(r is not None for cells in results for r in cells.values()))

    def keep(name: str, missing: list[int], k: int, records: list[dict[str, Any]], seconds: float) -> None:
        g = missing[k]
        dataset, b, _ = work[g]
        stores[dataset].put(b, name, cell_print(prints[g], specs[name]), records, seconds)
        results[g][name] = records
        log.info("%s batch %d %s: %.0f s, load %s", dataset, b, name, seconds, machine.load_average())
        bar.update()

    for name in list(specs)[shard_index::shard_count]:  # a shard computes every N-th cell
        missing = [g for g in range(len(work)) if results[g][name] is None]
        if missing:
            bar.set_postfix_str(name)
            groups = [work[g][2] for g in missing]
            done = functools.partial(keep, name, missing)
            generate_cell(
                model, tokenizer, groups, specs[name], config.max_new_tokens, stop, config.batch_size, done
            )
    records: list[dict[str, Any]] = []
    costs: dict[str, dict[str, Any]] = {}
    complete = 0
    for g, (dataset, b, batch) in enumerate(work):
        if any(result is None for result in results[g].values()):
            continue  # another shard's cell, not finished yet
        complete += 1
        records.extend(_problem_records(batch, results[g], loops, numbers))
        for name, result in results[g].items():
            _add_cost(costs.setdefault(name, {}), stores[dataset].cost(b, name), result)
    bar.close()
    summary = summarize_loops(records, plan, config.references)
    for cell, share in shifted_cells(summary).items():  # issue 33: a shifted run is flagged here
        log.warning(
            "%s: %.0f%% of its generations left full's trace before any eviction (over %.0f%%): "
            "numerics, not eviction, drive its differences",
            cell, 100 * share, 100 * SHIFT_LIMIT,
        )  # fmt: skip
    results_doc = {
        "model": model_loading.model_name(model),
        "plan": plan,
        "specs": {name: spec.config() for name, spec in specs.items()},
        "batches": {"total": len(work), "complete": complete},
        "seconds": round(time.perf_counter() - started, 1),
        "load_average": machine.load_average(),
        "cost": costs,
        "problems": records,
        "summary": summary,
    }
    return documents.make_document("loops", config, results_doc, config.device, reporter.specs)


def _parts(config: LoopsConfig, dataset: str) -> Parts:
    return dataset_parts(config.parts_dir, dataset)


def dataset_parts(parts_dir: str | None, dataset: str) -> Parts:
    """One dataset's parts in a study's parts folder (none kept when ``parts_dir`` is None)."""
    return Parts(str(Path(parts_dir) / _safe(dataset)) if parts_dir else None)


def _batches(config: LoopsConfig, tokenizer: Any) -> list[tuple[str, int, list[Problem]]]:
    """(dataset, batch number within it, problems) for every batch of the study, dataset by dataset."""
    work = []
    for dataset, count, offset in zip(config.datasets, config.problems, config.offsets, strict=True):
        problems = load_problems(dataset, count, offset, tokenizer, config.system_prompt)
        for b, lo in enumerate(range(0, count, config.batch_size)):
            work.append((dataset, b, problems[lo : lo + config.batch_size]))
    return work


def _add_cost(total: dict[str, Any], part: dict[str, Any] | None, result: list[dict[str, Any]]) -> None:
    """Per cell: wall seconds of its (batch, cell) parts, tokens generated, tokens/s and the load
    average at the end of each part (what the next session needs to plan a run)."""
    tokens = sum(len(r.get("token_ids", ())) for r in result)
    total["tokens"] = total.get("tokens", 0) + tokens
    total["parts"] = total.get("parts", 0) + 1
    if part is not None and part["seconds"]:
        total["seconds"] = round(total.get("seconds", 0.0) + part["seconds"], 1)
        total.setdefault("load_average", []).append(part["load_average"])
        total["tokens_per_second"] = round(total["tokens"] / total["seconds"], 2)


def _problem_records(
    batch: list[Problem], results: dict[str, Any], loops: LoopConfig, numbers: frozenset[int]
) -> list[dict[str, Any]]:
    out = []
    for i, problem in enumerate(batch):
        raw = {
            "dataset": problem.dataset,
            "id": problem.example.id,
            "gold": problem.example.answer,
            "prompt_tokens": len(problem.prompt),
            "cells": {name: cell[i] for name, cell in results.items()},
        }
        out.append(problem_facts(raw, loops, numbers))
    return out


# --------------------------------------------------------------------------- Ray shards


def _shard_task(config: LoopsConfig) -> int:
    """What one Ray task does: compute its shard's missing parts (its document is not kept)."""
    done = run_loops(config)
    return int(done["results"]["batches"]["complete"])


def _run_on_ray(config: LoopsConfig) -> None:
    """The ``shards`` shards as Ray tasks writing one parts folder (the eval's connection and retry
    rules); the caller then assembles the parts. A failed shard is reported after all finish."""
    from epikv.cluster import connected, gpus_or_default
    from epikv.eval.ray_runner import MAX_RETRIES, describe_task_error

    folder = str(Path(config.parts_dir or "").resolve())
    shards = [
        dataclasses.replace(config, ray=None, parts_dir=folder, shard=f"{i}/{config.shards}")
        for i in range(config.shards)
    ]
    address = None if config.ray in ("", "local") else config.ray
    failures = []
    with connected(address) as ray:
        resources = {"num_cpus": float(config.threads or 1), "num_gpus": gpus_or_default(ray, None)}
        remote = ray.remote(max_retries=MAX_RETRIES, **resources)(_shard_task)
        refs = [remote.remote(shard) for shard in shards]
        for ref, shard in zip(refs, shards, strict=True):
            try:
                ray.get(ref)
            except Exception as err:  # a task error or a lost worker; the other shards go on
                failures.append(f"shard {shard.shard}: {describe_task_error(err)}")
    if failures:
        raise RuntimeError(
            "loop study: " + "; ".join(failures) + " (finished parts are kept: run the same command again)"
        )


def plot_loops(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Ranked interval plots of loop, cap-hit and accuracy rates beside the memory view."""
    from epikv.bench.loops.plots import plot_document

    return plot_document(json_path, png)
