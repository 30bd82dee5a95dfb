"""How close each policy stays to the full cache on the same text: the fidelity study.

The honest proxy for accuracy on a machine that cannot hold a 7B model. Prompts come from the genres
of :mod:`epikv.bench.fidelity.genres` (``--genres``: shipped text that is teacher-forced, or GSM8K/MATH-500
problems whose continuation is the model's own greedy full-cache trace), or, without genres, from a
bundled task or file (greedy traces). For every prompt the full cache gives the reference next-token
distributions; then for every *cell* (a policy, possibly with parameters, at one budget K), the
prompts run as one batch of the engine (:class:`epikv.engine.Engine`, ``batch_size`` rows):

* teacher forcing: the continuation is fed token by token; at each position we record top-1
  agreement with the full cache's next token, KL(full || evicted) and the continuation token's
  negative log-likelihood, averaged over all positions, over the positions after the cell's first
  eviction, and over the last ``tail_tokens`` positions (a window every cell has evicted before, so
  cells that start evicting at different times are compared on the same positions); the peak and
  mean cached tokens; and where the kept tokens sit (a histogram of the kept true positions at the
  compactions, through the engine's ``on_compaction`` observer);
* free running (generated genres): the policy generates the same number of greedy tokens itself; we
  record where it first leaves the full cache's trace and whether it ends in a loop.

Cells are the policies at the ``budgets`` (equal K) and at the ``peaks`` (equal peak memory: each
policy's K = peak - tau, so a policy that compacts every tau steps holds as many tokens at its peak
as one that evicts every step). Each (batch, cell) is written to ``parts_dir`` as it finishes and a
rerun skips the parts already there, so a study of hours survives an interruption. Statistics and
tables: :mod:`epikv.bench.fidelity.summary`; figures: :mod:`epikv.bench.fidelity.plots`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epikv.bench.fidelity.runs import (
    _Recorder,
    forced_references,
    free_run,
    full_traces,
    teacher_force,
)
from epikv.bench.fidelity.summary import summarize_fidelity
from epikv.bench.shared import documents, machine, model_loading, prompt_loading
from epikv.bench.shared.parts import Parts, cell_print, fingerprint_of
from epikv.eval.loops import LoopConfig, first_mismatch, shortest_loop_period
from epikv.integration import build_spec
from epikv.spec import CacheSpec, budget_for_peak, parse_rank_every

__all__ = ["FidelityConfig", "_Recorder", "forced_references", "free_run", "full_traces", "teacher_force"]

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("epikv", "epikv-flat", "streaming", "h2o")
FREE_RUN = ("none", "generated")


@dataclass(frozen=True)
class FidelityConfig:
    """Prompts x cells. ``policies`` are names or variants ``name:key=value:...`` (policy parameters,
    e.g. ``epikv-flat:band_a=9:band_b=20``); ``budgets`` give every policy the same K, ``peaks`` give
    each policy the K whose peak K + tau is that many tokens; ``interval`` None = each policy's tau;
    ``rank_every`` (rho, issue 56) runs every evicting cell at tau = 1, ranking every rho steps.
    ``prompts`` is per genre; ``max_prompt_tokens`` drops longer prompts of generated genres;
    ``parts_dir`` (the CLI sets it beside the result) keeps finished cells for a rerun."""

    model: str | None = None
    genres: tuple[str, ...] = ()
    prompt_source: str = "math500"
    prompts: int = 4
    prompt_offset: int = 0
    prompt_tokens: int = 96
    max_prompt_tokens: int | None = None
    trace_tokens: int = 512
    policies: tuple[str, ...] = DEFAULT_POLICIES
    budgets: tuple[int, ...] = (256, 384)
    peaks: tuple[int, ...] = ()
    reference: str = "streaming"
    interval: int | None = None
    attention: str = "recompute"
    chat: bool = True
    stop_at_eos: bool = False
    free_run: str = "generated"
    tail_tokens: int = 128
    histogram_bins: int = 20
    histogram_every: int = 16
    loop_min_span: int = 32
    loop_max_period: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    batch_size: int = 8
    parts_dir: str | None = None
    rank_every: int | None = None

    def __post_init__(self) -> None:
        parse_rank_every(self.rank_every, self.interval)
        if self.prompts < 1 or self.trace_tokens < 2 or not self.policies:
            raise ValueError("need prompts >= 1, trace_tokens >= 2 and some policies")
        if not self.budgets and not self.peaks:
            raise ValueError("need some budgets (equal K) or peaks (equal peak memory)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.loop_min_span < 2 or self.loop_max_period < 1:
            raise ValueError("loop_min_span must be >= 2 and loop_max_period >= 1")
        if self.free_run not in FREE_RUN:
            raise ValueError(f"free_run must be one of {FREE_RUN}, got {self.free_run!r}")
        if min(self.tail_tokens, self.histogram_bins, self.histogram_every) < 1:
            raise ValueError("tail_tokens, histogram_bins and histogram_every must be >= 1")


# About two minutes on 2 cores: one short GSM8K prompt, an 80-token trace, two budgets.
QUICK = FidelityConfig(
    prompt_source="gsm8k",
    prompt_offset=1,
    prompts=1,
    trace_tokens=80,
    policies=("epikv", "epikv-flat", "h2o"),
    budgets=(80, 112),
    tail_tokens=16,
)


# --------------------------------------------------------------------------- pure helpers


def _loops(config: FidelityConfig) -> LoopConfig:
    """The fidelity study's loop rule: a tail of at least ``loop_min_span`` tokens and 3 periods."""
    return LoopConfig(min_span=config.loop_min_span, min_repeats=3, max_period=config.loop_max_period)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name:key=value:key=value`` -> (policy name, raw parameters), parsed later by the policy's
    field types (:func:`epikv.spec.parse_policy_params`)."""
    name, *items = text.strip().split(":")
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"policy variant {text!r}: {item!r} is not key=value")
        params[key] = value
    if not name:
        raise ValueError(f"policy variant {text!r} has no policy name")
    return name, params


@dataclass(frozen=True)
class Cell:
    """One policy variant at one budget (ranked every ``rank_every`` steps when set: its own cell,
    named so); ``label`` is the variant as given."""

    label: str
    budget: int
    rank_every: int | None = None

    @property
    def name(self) -> str:
        return f"{self.label}@{self.budget}" + ("" if self.rank_every is None else f" rho={self.rank_every}")


def plan_cells(
    model: torch.nn.Module, config: FidelityConfig
) -> tuple[dict[str, CacheSpec], list[dict[str, Any]]]:
    """The specs of every cell (name -> spec) and the plan: one entry per (variant, budget or peak),
    with the K matched to a peak or the reason no K can match it."""
    specs: dict[str, CacheSpec] = {}
    plan = []
    for label in config.policies:
        name, params = parse_variant(label)
        rho, largest = config.rank_every, max(config.budgets + config.peaks)
        probe = build_spec(model, name, largest, interval=config.interval, params=params, rank_every=rho)
        tau = probe.interval if probe.evicts else 0
        wanted = [("budget", k, k) for k in config.budgets]
        for peak in config.peaks:
            try:
                wanted.append(("peak", peak, budget_for_peak(peak, max(tau, 1))))
            except ValueError as err:
                plan.append({"label": label, "kind": "peak", "target": peak, "budget": None, "why": str(err)})
        for kind, target, k in wanted:
            cell = Cell(label, k, probe.rank_every)  # rho only where the policy evicts
            plan.append({"label": label, "kind": kind, "target": target, "budget": k, "cell": cell.name})
            if cell.name not in specs:
                specs[cell.name] = build_spec(
                    model, name, k, interval=config.interval, attention=config.attention, params=params,
                    rank_every=rho,
                )  # fmt: skip
    return specs, plan


# --------------------------------------------------------------------------- the study


@dataclass(frozen=True)
class Item:
    """One prompt of the study; ``continuation`` None = the full cache's greedy trace is the text."""

    genre: str
    id: str
    prompt: list[int]
    continuation: list[int] | None


def load_items(config: FidelityConfig, tokenizer: Any) -> list[Item]:
    """The study's prompts, genre by genre (``prompts`` each), or from ``prompt_source``."""
    from epikv.bench.fidelity.genres import load_genre

    if not config.genres:
        texts = prompt_loading.load_prompts(config.prompt_source, config.prompts, config.prompt_offset)
        return [
            Item(
                config.prompt_source,
                str(config.prompt_offset + i),
                prompt_loading.prompt_token_ids(tokenizer, t, config.chat),
                None,
            )
            for i, t in enumerate(texts)
        ]
    items = []
    for genre in config.genres:
        loaded = load_genre(
            genre,
            tokenizer,
            prompt_tokens=config.prompt_tokens,
            trace_tokens=config.trace_tokens,
            count=None if config.max_prompt_tokens else config.prompts,
            offset=0 if config.max_prompt_tokens else config.prompt_offset,
            chat=config.chat,
        )
        if config.max_prompt_tokens:
            fits = [g for g in loaded if g.forced or len(g.prompt_ids) <= config.max_prompt_tokens]
            loaded = fits[config.prompt_offset : config.prompt_offset + config.prompts]
            if len(loaded) < config.prompts:
                raise ValueError(
                    f"genre {genre!r}: only {len(loaded)} prompts of <= {config.max_prompt_tokens} tokens"
                )
        for g in loaded:
            cont = list(g.continuation_ids) if g.continuation_ids is not None else None
            items.append(Item(genre, g.id, list(g.prompt_ids), cont))
    return items


def _reference(
    model: torch.nn.Module, batch: list[Item], config: FidelityConfig, stop: set[int] | None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Continuations and the full cache's log-probabilities along them, forced and generated items
    each in one engine run."""
    traces: list[list[int]] = [[] for _ in batch]
    refs: list[torch.Tensor] = [torch.empty(0) for _ in batch]
    forced = [i for i, item in enumerate(batch) if item.continuation is not None]
    generated = [i for i, item in enumerate(batch) if item.continuation is None]
    if forced:
        done = forced_references(
            model, [batch[i].prompt for i in forced], [batch[i].continuation for i in forced]
        )
        for i, (trace, ref) in zip(forced, done, strict=True):
            traces[i], refs[i] = trace, ref
    if generated:
        done = full_traces(model, [batch[i].prompt for i in generated], config.trace_tokens, stop)
        for i, (trace, ref) in zip(generated, done, strict=True):
            traces[i], refs[i] = trace, ref
    return traces, refs


def _run_cell(
    model: torch.nn.Module,
    batch: list[Item],
    traces: list[list[int]],
    refs: list[torch.Tensor],
    spec: CacheSpec,
    config: FidelityConfig,
) -> list[dict[str, Any]]:
    """One cell on one batch: teacher forced, then free running where the text is the model's own."""
    prompts = [item.prompt for item in batch]
    forced = teacher_force(
        model, prompts, traces, refs, spec, config.tail_tokens, config.histogram_bins, config.histogram_every
    )
    free = [
        i
        for i, (item, cell) in enumerate(zip(batch, forced, strict=True))
        if config.free_run == "generated" and item.continuation is None and "skipped" not in cell
    ]
    if free:
        generated = free_run(model, [prompts[i] for i in free], config.trace_tokens, spec)
        for i, tokens in zip(free, generated, strict=True):
            period = shortest_loop_period(tokens, _loops(config))
            forced[i].update(
                first_divergence=first_mismatch(traces[i], tokens[: len(traces[i])]), loop_period=period
            )
    return forced


def _prompt_record(item: Item, trace: list[int], ref: torch.Tensor, config: FidelityConfig) -> dict[str, Any]:
    nll = -ref.gather(1, torch.tensor(trace)[:, None])[:, 0]
    return {
        "genre": item.genre,
        "id": item.id,
        "prompt_tokens": len(item.prompt),
        "trace_tokens": len(trace),
        "full_nll": float(nll.mean()),
        "full_nll_tail": float(nll[-config.tail_tokens :].mean()),
        "full_loop_period": shortest_loop_period(trace, _loops(config)),
        "cells": {},
    }


def run_fidelity(
    config: FidelityConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    reporter: documents.Reporter | None = None,
) -> dict[str, Any]:
    """Every prompt x cell, ``batch_size`` prompts at a time, finished cells kept in ``parts_dir``;
    returns the document (per-prompt results, the summary with intervals, the plan)."""
    from epikv.generation import eos_ids

    reporter = reporter or documents.Reporter()
    machine.set_threads(config.threads)
    if model is None:
        model, tokenizer = model_loading.load_bench_model(config.model, config.device, config.dtype)
    specs, plan = plan_cells(model, config)
    stop = set(eos_ids(model, tokenizer)) if config.stop_at_eos else None
    for spec in specs.values():
        reporter.uses(spec)
    items = load_items(config, tokenizer)
    parts = Parts(config.parts_dir)
    keys = ("trace_tokens", "stop_at_eos", "tail_tokens", "histogram_bins", "histogram_every", "free_run")
    settings = {k: getattr(config, k) for k in keys} | {"model": model_loading.model_name(model)}
    prompts: list[dict[str, Any]] = []
    started = time.perf_counter()
    batches = range(0, len(items), config.batch_size)
    bar = reporter.bar(len(batches) * (1 + len(specs)), "fidelity", unit="run")  # full + each cell
    for b, lo in enumerate(batches):
        batch = items[lo : lo + config.batch_size]
        fingerprint = fingerprint_of([[i.genre, i.id, i.prompt, i.continuation] for i in batch], settings)
        done = {name: parts.get(b, name, cell_print(fingerprint, spec)) for name, spec in specs.items()}
        records = parts.get(b, "full", fingerprint)
        traces: list[list[int]] = []
        refs: list[torch.Tensor] = []
        if records is None or any(result is None for result in done.values()):
            traces, refs = _reference(model, batch, config, stop)
            records = [_prompt_record(i, t, r, config) for i, t, r in zip(batch, traces, refs, strict=True)]
            parts.put(b, "full", fingerprint, records, 0.0)
        bar.update()
        for name, spec in specs.items():
            if done[name] is None:
                t0 = time.perf_counter()
                done[name] = _run_cell(model, batch, traces, refs, spec, config)
                parts.put(b, name, cell_print(fingerprint, spec), done[name], time.perf_counter() - t0)
                log.info(
                    "batch %d cell %s: %.0f s, load %s",
                    b,
                    name,
                    time.perf_counter() - t0,
                    machine.load_average(),
                )
            bar.set_postfix_str(name)
            bar.update()
            for record, result in zip(records, done[name], strict=True):
                record["cells"][name] = result
        prompts.extend(records)
        del refs
    bar.close()
    results = {
        "model": model_loading.model_name(model),
        "plan": plan,
        "specs": {name: spec.config() for name, spec in specs.items()},
        "seconds": round(time.perf_counter() - started, 1),
        "prompts": prompts,
    }
    results["summary"] = summarize_fidelity(prompts, plan, config)
    return documents.make_document("fidelity", config, results, config.device, reporter.specs)


def plot_fidelity(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Agreement against mean cached tokens per genre and policy (and the kept-position figure)."""
    from epikv.bench.fidelity.plots import plot_document

    return plot_document(json_path, png)
