"""How close each policy stays to the full cache on the same greedy reasoning traces.

The honest proxy for accuracy on a machine that cannot hold a 7B model. For every prompt (a bundled
task read with ``json``, a ``.jsonl`` file or any text file) a greedy full-cache trace of T tokens
is generated (EOS ignored unless asked) with its next-token distributions. Then, per policy and
budget, every run a batch of the engine (:class:`epikv.engine.Engine`, ``batch_size`` prompts):

* teacher forcing: the trace is fed token by token (forced requests); at each position we record
  top-1 agreement with the full cache's next token, KL(full || evicted) and the trace token's
  negative log-likelihood, overall and over the positions after the first eviction;
* free running: the policy generates T greedy tokens itself; we record the first position where it
  leaves the full trace and whether it ends in a loop (:func:`repeated_suffix`).

A (policy, budget) whose budget cannot hold a prompt's protected tokens is reported as skipped.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epikv.bench import io
from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.spec import CacheSpec

DEFAULT_POLICIES = ("epikv", "epikv-flat", "streaming", "h2o")


@dataclass(frozen=True)
class FidelityConfig:
    """Prompts x policies x budgets; ``interval`` None = each policy's own tau."""

    model: str | None = None
    prompt_source: str = "math500"
    prompts: int = 4
    prompt_offset: int = 0
    trace_tokens: int = 512
    policies: tuple[str, ...] = DEFAULT_POLICIES
    budgets: tuple[int, ...] = (256, 384)
    interval: int | None = None
    attention: str = "recompute"
    chat: bool = True
    stop_at_eos: bool = False
    loop_min_span: int = 32
    loop_max_period: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.trace_tokens < 2 or not self.budgets or not self.policies:
            raise ValueError("need prompts >= 1, trace_tokens >= 2, some budgets and some policies")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.loop_min_span < 2 or self.loop_max_period < 1:
            raise ValueError("loop_min_span must be >= 2 and loop_max_period >= 1")


# About two minutes on 2 cores: one short GSM8K prompt, an 80-token trace, two budgets.
QUICK = FidelityConfig(
    prompt_source="gsm8k",
    prompt_offset=1,
    prompts=1,
    trace_tokens=80,
    policies=("epikv", "epikv-flat", "h2o"),
    budgets=(80, 112),
)


# --------------------------------------------------------------------------- pure helpers


def repeated_suffix(
    tokens: list[int], max_period: int = 64, min_span: int = 32, min_repeats: int = 3
) -> int | None:
    """The smallest period p <= max_period such that the last max(min_span, p * min_repeats)
    tokens repeat with period p (the text is stuck in a loop), or None."""
    n = len(tokens)
    for period in range(1, max_period + 1):
        span = max(min_span, period * min_repeats)
        if span > n:
            break
        tail = tokens[n - span :]
        if tail[period:] == tail[:-period]:
            return period
    return None


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """Index of the first differing token, or None when ``other`` follows ``reference`` throughout."""
    for index, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return index
    return None


# --------------------------------------------------------------------------- model runs


class _Recorder:
    """on_logits of one request: keeps log-probabilities, or compares them with a reference."""

    def __init__(self, reference: torch.Tensor | None = None, trace: list[int] | None = None) -> None:
        self.reference, self.trace = reference, trace
        self.logprobs: list[torch.Tensor] = []
        self.agree: list[float] = []
        self.kl: list[float] = []
        self.nll: list[float] = []
        self.evicted: list[bool] = []

    def __call__(self, index: int, logits: torch.Tensor, evicted: bool) -> None:
        lp = torch.log_softmax(logits.float(), dim=-1).cpu()
        if self.reference is None:
            self.logprobs.append(lp)
            return
        full = self.reference[index]
        self.agree.append(float(int(lp.argmax()) == int(full.argmax())))
        self.kl.append(float((full.exp() * (full - lp)).sum()))
        self.nll.append(float(-lp[self.trace[index]]))
        self.evicted.append(evicted)

    def metrics(self, peak: int) -> dict[str, Any]:
        after = [i for i, e in enumerate(self.evicted) if e]
        return {
            "agreement": statistics.fmean(self.agree),
            "agreement_after_eviction": statistics.fmean(self.agree[i] for i in after) if after else None,
            "kl": statistics.fmean(self.kl),
            "kl_after_eviction": statistics.fmean(self.kl[i] for i in after) if after else None,
            "nll": statistics.fmean(self.nll),
            "first_eviction_step": after[0] if after else None,
            "peak_cache_tokens": peak,
        }


def full_traces(
    model: torch.nn.Module, prompts: list[list[int]], tokens: int, stop: set[int] | None = None
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy full-cache traces, each with the log-probabilities (T, V) that predicted its tokens."""
    spec = build_spec(model, "full")
    recorders = [_Recorder() for _ in prompts]
    requests = [
        Request(ids, tokens, stop_ids=frozenset(stop or ()), on_logits=rec)
        for ids, rec in zip(prompts, recorders, strict=True)
    ]
    done = Engine(model, spec).run(requests)
    return [(c.token_ids, torch.stack(r.logprobs)) for c, r in zip(done, recorders, strict=True)]


def teacher_force(
    model: torch.nn.Module,
    prompts: list[list[int]],
    traces: list[list[int]],
    references: list[torch.Tensor],
    spec: CacheSpec,
) -> list[dict[str, Any]]:
    """Feed each trace through ``spec``'s cache; compare every next-token distribution with its
    reference. A prompt the budget cannot hold gets ``{"skipped": reason}``."""
    engine = Engine(model, spec)
    out: list[dict[str, Any]] = [{} for _ in prompts]
    runs = []
    for i, (ids, trace, reference) in enumerate(zip(prompts, traces, references, strict=True)):
        recorder = _Recorder(reference, trace)
        request = Request(ids, len(trace), forced=trace, on_logits=recorder)
        try:
            engine.validate(request)
        except ValueError as err:  # the budget cannot hold this prompt's protected tokens
            out[i] = {"skipped": str(err)}
            continue
        runs.append((i, request, recorder))
    done = engine.run([request for _, request, _ in runs])
    for (i, _, recorder), completion in zip(runs, done, strict=True):
        out[i] = recorder.metrics(completion.peak_cache_tokens)
    return out


def free_run(
    model: torch.nn.Module, prompts: list[list[int]], tokens: int, spec: CacheSpec
) -> list[list[int]]:
    """``tokens`` greedy tokens generated under ``spec`` for each prompt (EOS ignored)."""
    return [c.token_ids for c in Engine(model, spec).run([Request(ids, tokens) for ids in prompts])]


# --------------------------------------------------------------------------- the benchmark


def _cells(
    model: torch.nn.Module,
    prompts: list[list[int]],
    traces: list[list[int]],
    references: list[torch.Tensor],
    spec: CacheSpec,
    config: FidelityConfig,
) -> list[dict[str, Any]]:
    """One (policy, budget) on a batch of prompts: teacher forced, then free running."""
    forced = teacher_force(model, prompts, traces, references, spec)
    runnable = [i for i, cell in enumerate(forced) if "skipped" not in cell]
    generated = free_run(model, [prompts[i] for i in runnable], config.trace_tokens, spec) if runnable else []
    for i, tokens in zip(runnable, generated, strict=True):
        period = repeated_suffix(tokens, config.loop_max_period, config.loop_min_span)
        forced[i].update(
            first_divergence=first_divergence(traces[i], tokens[: len(traces[i])]), loop_period=period
        )
    return forced


def _every_cell(
    model: torch.nn.Module,
    prompts: list[list[int]],
    traces: list[list[int]],
    references: list[torch.Tensor],
    specs: dict[tuple[str, int], CacheSpec],
    config: FidelityConfig,
    bar: Any,
) -> dict[str, list[dict[str, Any]]]:
    """Every (policy, budget) on one batch of prompts, keyed ``policy@budget``; one bar step each."""
    cells = {}
    for (policy, budget), spec in specs.items():
        bar.set_postfix_str(f"{policy}@{budget}")
        cells[f"{policy}@{budget}"] = _cells(model, prompts, traces, references, spec, config)
        bar.update()
    return cells


def run_fidelity(
    config: FidelityConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    reporter: io.Reporter | None = None,
) -> dict[str, Any]:
    """Every prompt x policy x budget, ``batch_size`` prompts at a time; returns the document."""
    from epikv.bench.speed import available_policies
    from epikv.generation import eos_ids

    reporter = reporter or io.Reporter()
    io.set_threads(config.threads)
    if model is None:
        model, tokenizer = io.load_bench_model(config.model, config.device, config.dtype)
    policies, missing = available_policies(config.policies)
    stop = set(eos_ids(model, tokenizer)) if config.stop_at_eos else None
    texts = io.load_prompts(config.prompt_source, config.prompts, config.prompt_offset)
    specs = {
        (policy, budget): build_spec(
            model, policy, budget, interval=config.interval, attention=config.attention
        )
        for policy in policies
        for budget in config.budgets
    }
    for spec in specs.values():
        reporter.uses(spec)
    prompts = []
    batches = range(0, len(texts), config.batch_size)
    bar = reporter.bar(len(batches) * (1 + len(specs)), "fidelity", unit="run")  # full trace + each spec
    for lo in batches:
        ids = [
            io.encode_prompt_ids(tokenizer, text, config.chat) for text in texts[lo : lo + config.batch_size]
        ]
        traced = full_traces(model, ids, config.trace_tokens, stop)
        bar.update()
        traces, references = [t for t, _ in traced], [r for _, r in traced]
        cells = _every_cell(model, ids, traces, references, specs, config, bar)
        for j, (prompt, trace, reference) in enumerate(zip(ids, traces, references, strict=True)):
            nll = float(-reference.gather(1, torch.tensor(trace)[:, None]).mean())
            prompts.append(
                {
                    "index": config.prompt_offset + lo + j,
                    "prompt_tokens": len(prompt),
                    "trace_tokens": len(trace),
                    "full_nll": nll,
                    "full_loop_period": repeated_suffix(trace, config.loop_max_period, config.loop_min_span),
                    "cells": {name: batch[j] for name, batch in cells.items()},
                }
            )
    bar.close()
    results = {
        "model": io.model_name(model),
        "missing_policies": missing,
        "prompts": prompts,
        "summary": summarize_fidelity(prompts, policies, config.budgets),
    }
    return io.make_document("fidelity", config, results, config.device, reporter.specs)


def summarize_fidelity(
    prompts: list[dict[str, Any]], policies: list[str], budgets: tuple[int, ...]
) -> dict[str, Any]:
    """Means over prompts per (policy, budget); skipped prompts are counted, not averaged."""
    rows = []
    for policy in policies:
        for budget in budgets:
            cells = [p["cells"][f"{policy}@{budget}"] for p in prompts]
            done = [c for c in cells if "skipped" not in c]
            row: dict[str, Any] = {
                "policy": policy,
                "budget": budget,
                "prompts": len(done),
                "skipped": len(cells) - len(done),
            }
            for key in ("agreement", "agreement_after_eviction", "kl", "kl_after_eviction", "nll"):
                values = [c[key] for c in done if c[key] is not None]
                row[key] = statistics.fmean(values) if values else None
            lengths = [p["trace_tokens"] for p, c in zip(prompts, cells, strict=True) if "skipped" not in c]
            divergence = [
                c["first_divergence"] if c["first_divergence"] is not None else n
                for c, n in zip(done, lengths, strict=True)
            ]
            row["first_divergence"] = statistics.fmean(divergence) if divergence else None
            row["loop_rate"] = statistics.fmean(c["loop_period"] is not None for c in done) if done else None
            rows.append(row)
    full = {
        "nll": statistics.fmean(p["full_nll"] for p in prompts),
        "loop_rate": statistics.fmean(p["full_loop_period"] is not None for p in prompts),
    }
    return {"rows": rows, "full": full}


def _after(row: dict[str, Any], metric: str) -> float:
    """The metric over post-eviction positions, or over all positions when nothing was evicted."""
    value = row[f"{metric}_after_eviction"]
    return row[metric] if value is None else value


def plot_fidelity(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Top-1 agreement (after the first eviction) and KL(full || evicted) against budget, per policy."""
    data = io.read_result(json_path, "fidelity")
    results = data["results"]
    figure, (left, right) = io.new_figure(width=10.0, height=4.2, ncols=2)
    policies = list(dict.fromkeys(row["policy"] for row in results["summary"]["rows"]))
    for index, policy in enumerate(policies):
        rows = [r for r in results["summary"]["rows"] if r["policy"] == policy and r["prompts"]]
        budgets = [r["budget"] for r in rows]
        left.plot(
            budgets,
            [_after(r, "agreement") for r in rows],
            "o-",
            color=f"C{index}",
            label=policy,
        )
        right.plot(budgets, [_after(r, "kl") for r in rows], "o-", color=f"C{index}", label=policy)
    left.set_ylabel("top-1 agreement with full cache")
    right.set_ylabel("KL(full || evicted), nats")
    budgets = sorted({r["budget"] for r in results["summary"]["rows"]})
    for axes in (left, right):
        axes.set_xlabel("budget K (tokens)")
        axes.set_xscale("log", base=2)
        axes.set_xticks(budgets, [str(b) for b in budgets])
        axes.minorticks_off()
    left.legend(fontsize=8)
    cfg = data["config"]
    left.set_title(
        f"{results['model']}: {len(results['prompts'])} {cfg['prompt_source']} prompts, "
        f"T={cfg['trace_tokens']}",
        fontsize=9,
    )
    right.set_title("after the first eviction (teacher forced)", fontsize=9)
    return io.save_figure(figure, png or io.png_path(json_path))
