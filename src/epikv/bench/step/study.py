"""The decode step against the machine's memory-traffic bound (a roofline for the engine's hot path).

A decode step must at least read every weight once and every live key and value once, so its time
is bounded below by (weight bytes + live KV bytes) / memory bandwidth. This benchmark measures the
bandwidth (a large tensor copy at the run's thread count), then, for every dtype x policy x cached
tokens x batch, the median wall time of the cache's decode step (one forward of every row with the
cache's writes, the policy's ``observe`` and its hooks), and reports the two side by side with their
ratio. All cells run in one process, one after another, and the load average is recorded before and
after.

How a cell is set up, so it costs seconds instead of a long decode: one row is prefilled with a short
prompt and then extended by teacher forcing in one forward to ``cached - 1`` tokens (the policy sees
every token), and the batch is that row appended ``batch`` times. An evicting policy runs at
K = cached - tau, so the cell measures it at its peak (K + tau slots), the most a row holds; its
compaction is timed once on the whole batch and reported amortised over tau steps beside the step.
With ``rank_every`` (rho, issue 56) tau is 1: the timed steps each evict one token in place, and the
compaction timed is a ranking, amortised over rho steps.
The engine's own bookkeeping per step (token choice, callbacks) is not inside the timed call: it was
measured at 0.27 ms per step (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epikv.bench.shared import documents, figures, machine, model_loading
from epikv.engine.runner import Runner
from epikv.integration import build_spec
from epikv.spec import budget_at_peak, parse_rank_every

PROMPT_TOKENS = 32


@dataclass(frozen=True)
class StepConfig:
    """The grid of one run: batches x contexts (cached tokens per row) x dtypes x policies."""

    model: str | None = None
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (384, 1024, 2048)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    policies: tuple[str, ...] = ("full", "epikv")
    tokens: int = 6
    warmup: int = 2
    threads: int | None = 1
    device: str = "cpu"
    seed: int = 0
    rank_every: int | None = None

    def __post_init__(self) -> None:
        parse_rank_every(self.rank_every)
        for name in ("batches", "contexts", "dtypes", "policies"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        if min(self.batches) < 1 or min(self.contexts) <= PROMPT_TOKENS + 1:
            raise ValueError(f"batches must be >= 1 and contexts > {PROMPT_TOKENS + 1}, got {self}")
        if self.tokens < 1 or self.warmup < 0:
            raise ValueError(f"tokens must be >= 1 and warmup >= 0, got {self.tokens}, {self.warmup}")
        for dtype in self.dtypes:
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"dtype {dtype!r} is not a torch dtype (float32, bfloat16, ...)")


QUICK = StepConfig(batches=(1, 4), contexts=(384,), tokens=3)


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write counted), best of ``repeats``."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once


def kv_bytes(model: torch.nn.Module, rows: int, tokens: int, element: int) -> int:
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * rows * tokens * c.num_key_value_heads * head_dim * element


def _source_row(runner: Runner, context: int, seed: int, vocab: int):
    """One row holding ``context - 1`` tokens, its policy state real (teacher-forced in one pass)."""
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = runner.new_cache()
    runner.prefill(cache, ids[:PROMPT_TOKENS])
    runner.extend(cache, ids[PROMPT_TOKENS:-1])
    return cache


def time_cell(runner: Runner, source: Any, batch: int, config: StepConfig) -> dict[str, Any]:
    """Median decode-step time of ``batch`` copies of ``source``, and one compaction's time."""
    cache = runner.new_cache()
    for _ in range(batch):
        cache.append(source)
    tokens = torch.zeros(batch, dtype=torch.long, device=runner.device)
    times = []
    with runner.attachment:
        for index in range(config.warmup + config.tokens):
            start = time.perf_counter()
            tokens = runner.decode(cache, tokens).argmax(dim=-1)
            if index >= config.warmup:
                times.append(time.perf_counter() - start)
        compact_s = None
        if cache.budget is not None:
            start = time.perf_counter()
            cache.compact()
            compact_s = time.perf_counter() - start
    return {
        "step_ms": 1e3 * statistics.median(times),
        "step_ms_all": [1e3 * t for t in times],
        "cached_tokens": max(cache.held) if compact_s is None else None,
        "compact_ms": None if compact_s is None else 1e3 * compact_s,
        "kv_bytes_allocated": cache.kv_bytes(),
    }


def run_step(
    config: StepConfig, model: torch.nn.Module | None = None, reporter: documents.Reporter | None = None
) -> dict[str, Any]:
    """Every cell of ``config``; returns the step document."""
    reporter = reporter or documents.Reporter()
    machine.set_threads(config.threads)
    load_before = machine.load_average()
    bandwidth = copy_bandwidth()
    cells = []
    total = len(config.dtypes) * len(config.policies) * len(config.contexts) * len(config.batches)
    with reporter.bar(total, "step", unit="cell") as bar:
        for dtype in config.dtypes:
            if model is not None:
                loaded = model.to(getattr(torch, dtype))
            else:
                loaded = model_loading.load_bench_model(config.model, config.device, dtype)[0]
            weights = weight_bytes(loaded)
            element = next(loaded.parameters()).element_size()
            for policy in config.policies:
                for context in config.contexts:
                    tau = None if config.rank_every is None else 1
                    budget = budget_at_peak(policy, context, tau) if policy != "full" else None
                    spec = build_spec(loaded, policy, budget, rank_every=config.rank_every)
                    reporter.uses(spec)
                    runner = Runner(loaded, spec)
                    source = _source_row(runner, context, config.seed, loaded.config.vocab_size)
                    for batch in config.batches:
                        cell = time_cell(runner, source, batch, config)
                        traffic = weights + kv_bytes(loaded, batch, context, element)
                        bound_ms = 1e3 * traffic / bandwidth
                        every = spec.rank_every or spec.interval  # steps one compaction serves
                        amortised = cell["step_ms"] + (cell["compact_ms"] or 0.0) / every
                        cells.append(
                            {
                                "dtype": dtype,
                                "policy": policy,
                                "budget": budget,
                                "interval": spec.interval,
                                **({} if spec.rank_every is None else {"rank_every": spec.rank_every}),
                                "context": context,
                                "batch": batch,
                                **cell,
                                "step_ms_with_compaction": amortised,
                                "traffic_bytes": traffic,
                                "bound_ms": bound_ms,
                                "ratio": cell["step_ms"] / bound_ms,
                            }
                        )
                        bar.update(1)
    results = {
        "model": model_loading.model_name(loaded),
        "bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weights,
        "load_average_before": load_before,
        "load_average_after": machine.load_average(),
        "cells": cells,
    }
    return documents.make_document("step", config, results, config.device, reporter.specs)


def markdown(document: dict[str, Any]) -> str:
    """The roofline table: one row per cell, measured against bound."""
    lines = [
        "| dtype | policy | cached/row | batch | step ms | +compaction/tau | bound ms | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in document["results"]["cells"]:
        lines.append(
            f"| {c['dtype']} | {c['policy']} | {c['context']:,} | {c['batch']} | {c['step_ms']:.1f} | "
            f"{c['step_ms_with_compaction']:.1f} | {c['bound_ms']:.1f} | {c['ratio']:.2f} |"
        )
    return "\n".join(lines)


def plot_step(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Measured step / traffic bound against cached tokens, one panel per dtype, a line per policy x batch."""
    data = documents.read_result(json_path, "step")
    cells, cfg = data["results"]["cells"], data["config"]
    figure, axes = figures.new_figure(width=5.0 * len(cfg["dtypes"]), height=4.2, ncols=len(cfg["dtypes"]))
    for panel, dtype in zip(axes, cfg["dtypes"], strict=True):
        for i, policy in enumerate(cfg["policies"]):
            for j, batch in enumerate(cfg["batches"]):
                mine = [c for c in cells if (c["dtype"], c["policy"], c["batch"]) == (dtype, policy, batch)]
                panel.plot(
                    [c["context"] for c in mine],
                    [c["ratio"] for c in mine],
                    marker="o",
                    color=f"C{j}",
                    linestyle="-" if i == 0 else "--",
                    label=f"{policy}, batch {batch}",
                )
        panel.axhline(1.0, color="grey", linewidth=1)
        panel.set_xlabel("cached tokens per row")
        panel.set_ylabel("measured step / traffic bound")
        panel.set_title(f"{data['results']['model']}, {dtype}", fontsize=9)
        panel.legend(fontsize=7)
    return figures.save_figure(figure, png or figures.png_path(json_path))
