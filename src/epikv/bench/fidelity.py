"""How close each policy stays to the full cache on the same greedy reasoning traces.

The honest proxy for accuracy on a machine that cannot hold a 7B model. For every prompt (a bundled
task read with ``json``, a ``.jsonl`` file or any text file) a greedy full-cache trace of T tokens
is generated (EOS ignored unless asked) with its next-token distributions. Then, per policy and
budget:

* teacher forcing: the trace is fed token by token through ``model(input_ids=tok, cache=cache)``
  inside ``epikv.attach``; at each position we record top-1 agreement with the full cache's next
  token, KL(full || evicted) and the trace token's negative log-likelihood, overall and over the
  positions after the first eviction;
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

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.trace_tokens < 2 or not self.budgets or not self.policies:
            raise ValueError("need prompts >= 1, trace_tokens >= 2, some budgets and some policies")
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


@torch.no_grad()
def full_trace(
    model: torch.nn.Module, ids: torch.Tensor, tokens: int, stop: set[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy full-cache trace and the log-probabilities (T, V) that predicted each of its tokens."""
    from epikv import attach

    out, logprobs = [], []
    with attach(model, "full") as cache:
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        for _ in range(tokens):
            lp = torch.log_softmax(logits[0, -1].float(), dim=-1)
            token = int(lp.argmax())
            out.append(token)
            logprobs.append(lp.cpu())
            if stop and token in stop:
                break
            logits = model(input_ids=ids.new_tensor([[token]]), cache=cache, use_cache=True).logits
    return out, torch.stack(logprobs)


@torch.no_grad()
def teacher_force(
    model: torch.nn.Module,
    ids: torch.Tensor,
    trace: list[int],
    reference: torch.Tensor,
    policy: str,
    budget: int,
    interval: int | None = None,
    attention: str = "recompute",
) -> dict[str, Any]:
    """Feed ``trace`` through ``policy``; compare each next-token distribution with ``reference``."""
    from epikv import attach

    agree, kl, nll, evicted = [], [], [], []
    with attach(model, policy, budget=budget, interval=interval, attention=attention) as cache:
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        before = 0  # compactions before the forward that made ``logits`` (the last one runs after it)
        for step, token in enumerate(trace):
            lp = torch.log_softmax(logits[0, -1].float(), dim=-1).cpu()
            full = reference[step]
            agree.append(float(int(lp.argmax()) == int(full.argmax())))
            kl.append(float((full.exp() * (full - lp)).sum()))
            nll.append(float(-lp[token]))
            evicted.append(before > 0)
            if step + 1 < len(trace):
                before = cache.compactions
                logits = model(input_ids=ids.new_tensor([[token]]), cache=cache, use_cache=True).logits
        peak = cache.stats()[0].peak_cache_tokens
    after = [i for i, e in enumerate(evicted) if e]
    return {
        "agreement": statistics.fmean(agree),
        "agreement_after_eviction": statistics.fmean(agree[i] for i in after) if after else None,
        "kl": statistics.fmean(kl),
        "kl_after_eviction": statistics.fmean(kl[i] for i in after) if after else None,
        "nll": statistics.fmean(nll),
        "first_eviction_step": after[0] if after else None,
        "peak_cache_tokens": peak,
    }


@torch.no_grad()
def free_run(
    model: torch.nn.Module,
    ids: torch.Tensor,
    tokens: int,
    policy: str,
    budget: int,
    interval: int | None = None,
    attention: str = "recompute",
) -> list[int]:
    """``tokens`` greedy tokens generated under ``policy`` (EOS ignored)."""
    from epikv import attach

    out = []
    with attach(model, policy, budget=budget, interval=interval, attention=attention) as cache:
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        for step in range(tokens):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if step + 1 < tokens:
                logits = model(input_ids=ids.new_tensor([[token]]), cache=cache, use_cache=True).logits
    return out


# --------------------------------------------------------------------------- the benchmark


def _one_cell(
    model: torch.nn.Module,
    ids: torch.Tensor,
    trace: list[int],
    reference: torch.Tensor,
    policy: str,
    budget: int,
    config: FidelityConfig,
) -> dict[str, Any]:
    try:
        forced = teacher_force(
            model, ids, trace, reference, policy, budget, config.interval, config.attention
        )
    except ValueError as err:  # the budget cannot hold this prompt's protected tokens
        return {"skipped": str(err)}
    generated = free_run(model, ids, len(trace), policy, budget, config.interval, config.attention)
    period = repeated_suffix(generated, config.loop_max_period, config.loop_min_span)
    return {**forced, "first_divergence": first_divergence(trace, generated), "loop_period": period}


def run_fidelity(
    config: FidelityConfig, model: torch.nn.Module | None = None, tokenizer: Any = None
) -> dict[str, Any]:
    """Every prompt x policy x budget; returns the fidelity document."""
    from epikv.bench.speed import available_policies
    from epikv.generation import eos_ids

    io.set_threads(config.threads)
    if model is None:
        model, tokenizer = io.load_bench_model(config.model, config.device, config.dtype)
    policies, missing = available_policies(config.policies)
    stop = set(eos_ids(model, tokenizer)) if config.stop_at_eos else None
    device = next(model.parameters()).device
    prompts = []
    for index, text in enumerate(io.load_prompts(config.prompt_source, config.prompts, config.prompt_offset)):
        ids = io.encode_prompt(tokenizer, text, config.chat).to(device)
        trace, reference = full_trace(model, ids, config.trace_tokens, stop)
        nll = float(-reference.gather(1, torch.tensor(trace)[:, None]).mean())
        period = repeated_suffix(trace, config.loop_max_period, config.loop_min_span)
        cells = {
            f"{policy}@{budget}": _one_cell(model, ids, trace, reference, policy, budget, config)
            for policy in policies
            for budget in config.budgets
        }
        prompts.append(
            {
                "index": config.prompt_offset + index,
                "prompt_tokens": ids.shape[1],
                "trace_tokens": len(trace),
                "full_nll": nll,
                "full_loop_period": period,
                "cells": cells,
            }
        )
    results = {
        "model": io.model_name(model),
        "missing_policies": missing,
        "prompts": prompts,
        "summary": summarize_fidelity(prompts, policies, config.budgets),
    }
    return io.make_document("fidelity", config, results, config.device)


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
