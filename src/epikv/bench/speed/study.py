"""Decode speed under each policy at budget K over a forced length (EOS ignored), side by side.

For every repeat, every policy decodes the same prompt for the same number of greedy tokens in this
process, the policies taking turns every ``chunk`` steps (order rotated between repeats), so a
change in the machine's load during the run reaches every policy alike. Per step it
records the wall time of the model call, the time the cache spent in ``end_step`` (the policy's
``observe`` plus bookkeeping plus any compaction) and in ``compact`` (scoring, selection, gather),
and the cache's slot count. Those two are timed by wrapping the bound methods of the one cache
instance; model forwards are not touched.

Reported per policy: tokens/s (decode only, median over repeats), per-step time against position,
the share of steady-state steps spent scoring and compacting, the step time against ``full`` at an
equal cache length, peak cached tokens against K + tau, and ratios to ``full`` and ``h2o`` (when
registered). Attention-scored policies run with ``attention`` rows from ``eager`` by default.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from epikv.bench.shared import documents, figures, machine, model_loading, prompt_loading
from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.policies import policy_class
from epikv.spec import budget_at_peak, parse_rank_every

DEFAULT_POLICIES = ("full", "epikv", "epikv-flat", "h2o")


@dataclass(frozen=True)
class SpeedConfig:
    """One side-by-side decode-speed run; ``interval`` None = each policy's own tau; ``rank_every``
    (rho, issue 56) runs every evicting policy at tau = 1, ranking every rho steps (peak K + 1)."""

    model: str | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    budget: int = 512
    peak: int | None = None
    tokens: int = 2048
    interval: int | None = None
    repeats: int = 2
    prompt_source: str = "gsm8k"
    prompt_index: int = 1
    chat: bool = True
    attention: str = "eager"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = 1
    bin_size: int = 64
    warmup: int = 8
    chunk: int = 16
    rank_every: int | None = None

    def __post_init__(self) -> None:
        parse_rank_every(self.rank_every, self.interval)
        if min(self.budget, self.repeats, self.bin_size, self.chunk) < 1 or self.tokens < 2:
            raise ValueError("budget, tokens (>= 2), repeats, bin_size and chunk must be positive")
        if not self.policies:
            raise ValueError("no policies to time")


# About a minute on 2 cores: K=128 over 128 forced tokens on the embedded model, one repeat.
QUICK = SpeedConfig(budget=128, tokens=128, repeats=1, bin_size=16)


@dataclass
class DecodeTrace:
    """Per-step timings of one forced decode."""

    policy: str
    interval: int
    prefill_s: float
    step_s: list[float] = field(default_factory=list)
    end_step_s: list[float] = field(default_factory=list)
    compact_s: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    peak_cache_tokens: int = 0
    mean_cache_tokens: float | None = None
    compactions: int = 0
    extra: Any = None


class _CacheProbe:
    """Times ``end_step`` and ``compact`` of one cache instance by wrapping its bound methods."""

    def __init__(self, cache: Any, sync: Callable[[], None]) -> None:
        self.end_step_s = self.compact_s = 0.0
        end_step, compact = cache.end_step, cache.compact

        def timed_end_step(signals: Any) -> None:
            started = time.perf_counter()
            end_step(signals)
            sync()
            self.end_step_s += time.perf_counter() - started

        def timed_compact(*args: Any) -> None:
            started = time.perf_counter()
            compact(*args)
            sync()
            self.compact_s += time.perf_counter() - started

        cache.end_step, cache.compact = timed_end_step, timed_compact

    def take(self) -> tuple[float, float]:
        out = (self.end_step_s, self.compact_s)
        self.end_step_s = self.compact_s = 0.0
        return out


class PolicyDecode:
    """One policy's forced greedy decode on an engine of its own, advanced a chunk of steps at a time.

    The engine's hooks are held only while a chunk runs (its cache and policy state persist), so
    several policies can take turns on one model and share the machine's load."""

    def __init__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        policy: str,
        budget: int | None,
        interval: int | None = None,
        attention: str = "eager",
        tokens: int = 1 << 30,
        rank_every: int | None = None,
    ) -> None:
        spec = build_spec(
            model, policy, budget, interval=interval, attention=attention, rank_every=rank_every
        )
        self.engine = Engine(model, spec)
        # EOS ignored; ``tokens`` is the cap, past what the caller decodes (the request never ends)
        self.request = Request(input_ids[0].tolist(), tokens)
        self.policy = policy
        self.sync = machine.synchronizer(input_ids.device)
        self.probe = _CacheProbe(self.engine.cache, self.sync)
        self.trace: DecodeTrace | None = None

    def prefill(self) -> None:
        started = time.perf_counter()
        self.engine.add(self.request)
        self.sync()
        self.trace = DecodeTrace(self.policy, self.engine.spec.interval, time.perf_counter() - started)
        self.probe.take()

    def advance(self, steps: int) -> None:
        trace, cache = self.trace, self.engine.cache
        with self.engine:
            for _ in range(steps):
                started = time.perf_counter()
                self.engine.step()
                self.sync()
                trace.step_s.append(time.perf_counter() - started)
                end_step_s, compact_s = self.probe.take()
                trace.end_step_s.append(end_step_s)
                trace.compact_s.append(compact_s)
                trace.slots.append(cache.layers[0].keys.shape[-2])

    def finish(self, on_finish: Callable[[Any], Any] | None = None) -> DecodeTrace:
        cache, trace = self.engine.cache, self.trace
        trace.peak_cache_tokens = cache.stats()[0].peak_cache_tokens
        trace.mean_cache_tokens = cache.stats()[0].mean_cache_tokens
        trace.compactions = cache.compactions
        trace.extra = on_finish(cache) if on_finish is not None else None
        return trace


def timed_decode(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policy: str,
    budget: int | None,
    tokens: int,
    interval: int | None = None,
    attention: str = "eager",
    on_finish: Callable[[Any], Any] | None = None,
) -> DecodeTrace:
    """Prefill, then ``tokens`` greedy steps ignoring EOS, timing every step; ``on_finish(cache)``
    may inspect the cache at the end (its answer is kept in ``trace.extra``)."""
    run = PolicyDecode(model, input_ids, policy, budget, interval, attention, tokens + 2)
    run.prefill()
    run.advance(tokens)
    return run.finish(on_finish)


def interleaved(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    policies: list[str],
    config: SpeedConfig,
    reporter: documents.Reporter | None = None,
    bar: Any = None,
) -> dict[str, DecodeTrace]:
    """All ``policies`` decode side by side, taking turns every ``config.chunk`` steps (``bar``, if
    given, advances by the steps each turn decodes)."""
    reporter = reporter or documents.Reporter()
    extra = {"tokens": config.tokens + 2, "rank_every": config.rank_every}
    runs = {
        p: PolicyDecode(model, input_ids, p, budget_of(config, p), config.interval, config.attention, **extra)
        for p in policies
    }
    for run in runs.values():
        reporter.uses(run.engine.spec)
        run.prefill()
    for done in range(0, config.tokens, config.chunk):
        for run in runs.values():
            run.advance(min(config.chunk, config.tokens - done))
            if bar is not None:
                bar.update(min(config.chunk, config.tokens - done))
    return {p: run.finish() for p, run in runs.items()}


def budget_of(config: SpeedConfig, policy: str) -> int:
    """The policy's K: ``budget``, or at equal peak memory (``peak`` set) peak - its own tau (1 with
    ``rank_every``)."""
    if config.peak is None or not policy_class(policy).evicts:
        return config.budget
    return budget_at_peak(policy, config.peak, 1 if config.rank_every is not None else config.interval)


def available_policies(wanted: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(registered, missing) among ``wanted`` (another engineer may not have added ``h2o`` yet)."""
    from epikv.policies import ALIASES, policy_names

    known = set(policy_names()) | set(ALIASES)
    return [p for p in wanted if p in known], [p for p in wanted if p not in known]


def run_speed(
    config: SpeedConfig,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    reporter: documents.Reporter | None = None,
) -> dict[str, Any]:
    """Time every registered policy of ``config``; returns the speed document."""
    reporter = reporter or documents.Reporter()
    machine.set_threads(config.threads)
    if model is None:
        model, tokenizer = model_loading.load_bench_model(config.model, config.device, config.dtype)
    text = prompt_loading.load_prompts(config.prompt_source, 1, config.prompt_index)[0]
    ids = prompt_loading.encode_prompt(tokenizer, text, config.chat).to(next(model.parameters()).device)
    policies, missing = available_policies(config.policies)
    timed_decode(model, ids, "full", None, config.warmup)  # first-call costs out of the way
    traces: dict[str, list[DecodeTrace]] = {p: [] for p in policies}
    with reporter.bar(config.repeats * len(policies) * config.tokens, "speed", unit="tok") as bar:
        for repeat in range(config.repeats):
            shift = repeat % len(policies)
            order = policies[shift:] + policies[:shift]
            for policy, trace in interleaved(model, ids, order, config, reporter, bar).items():
                traces[policy].append(trace)
    summaries = {
        p: summarize_policy(t, budget_of(config, p), ids.shape[1], config.bin_size) for p, t in traces.items()
    }
    equal_length_overhead(summaries, traces)
    results = {
        "model": model_loading.model_name(model),
        "prompt_tokens": ids.shape[1],
        "missing_policies": missing,
        "policies": summaries,
        "ratios": speed_ratios(summaries),
    }
    results["targets"] = speed_targets(results, config)
    return documents.make_document("speed", config, results, config.device, reporter.specs)


def _steady(trace: DecodeTrace) -> slice:
    """Steps from the first compaction on (all steps for a policy that never compacted)."""
    first = next((i for i, c in enumerate(trace.compact_s) if c > 0), 0)
    return slice(first, None)


def summarize_policy(
    traces: list[DecodeTrace], budget: int, prompt_tokens: int, bin_size: int
) -> dict[str, Any]:
    """Aggregate the repeats of one policy: speed, per-position series, overheads, cache bounds."""
    per_repeat = [len(t.step_s) / sum(t.step_s) for t in traces]
    mean_step = [statistics.fmean(values) for values in zip(*(t.step_s for t in traces), strict=True)]
    steady = [_steady(t) for t in traces]
    step_sum = sum(sum(t.step_s[s]) for t, s in zip(traces, steady, strict=True))
    end_sum = sum(sum(t.end_step_s[s]) for t, s in zip(traces, steady, strict=True))
    compact_sum = sum(sum(t.compact_s) for t in traces)
    compactions = sum(t.compactions for t in traces)
    interval, peak = traces[0].interval, max(t.peak_cache_tokens for t in traces)
    evicts = any(t.compactions for t in traces)
    steady_slots = [x for t, s in zip(traces, steady, strict=True) for x in t.slots[s]]
    return {
        "tokens_per_s": statistics.median(per_repeat),
        "tokens_per_s_repeats": per_repeat,
        "prefill_s": statistics.median(t.prefill_s for t in traces),
        "mean_step_ms": 1000 * statistics.fmean(mean_step),
        "steady_step_ms": 1000
        * step_sum
        / max(1, sum(len(t.step_s[s]) for t, s in zip(traces, steady, strict=True))),
        "steady_mean_slots": statistics.fmean(steady_slots) if steady_slots else None,
        "end_step_share_pct": 100 * end_sum / step_sum if step_sum else None,
        "compact_ms_per_call": 1000 * compact_sum / compactions if compactions else None,
        "compaction_share_pct": 100 * compact_sum / sum(sum(t.step_s) for t in traces),
        "compactions": compactions / len(traces),
        "interval": interval,
        "budget": budget,
        "peak_cache_tokens": peak,
        "mean_cache_tokens": _mean_known(t.mean_cache_tokens for t in traces),
        "bound_tokens": budget + interval if evicts else None,
        "within_bound": (peak <= budget + interval) if evicts else None,
        "series": _binned(traces, mean_step, prompt_tokens, bin_size),
    }


def _mean_known(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _binned(
    traces: list[DecodeTrace], mean_step: list[float], prompt_tokens: int, size: int
) -> dict[str, list]:
    position, tokens_per_s, step_ms, slots = [], [], [], []
    for lo in range(0, len(mean_step), size):
        chunk = mean_step[lo : lo + size]
        position.append(prompt_tokens + lo + len(chunk) / 2)
        tokens_per_s.append(len(chunk) / sum(chunk))
        step_ms.append(1000 * statistics.fmean(chunk))
        slots.append(statistics.fmean(traces[0].slots[lo : lo + size]))
    return {"position": position, "tokens_per_s": tokens_per_s, "step_ms": step_ms, "slots": slots}


def equal_length_overhead(summaries: dict[str, dict[str, Any]], traces: dict[str, list[DecodeTrace]]) -> None:
    """Add each evicting policy's steady step time against ``full``'s steps at the same cache length."""
    full = traces.get("full")
    for name, summary in summaries.items():
        length = summary["steady_mean_slots"]
        summary["vs_full_equal_length_pct"] = None
        if full is None or name == "full" or summary["bound_tokens"] is None or length is None:
            continue
        width = max(8, summary["interval"])
        near = [s for t in full for s, n in zip(t.step_s, t.slots, strict=True) if abs(n - length) <= width]
        if near:
            summary["vs_full_equal_length_pct"] = 100 * (
                summary["steady_step_ms"] / 1000 / statistics.fmean(near) - 1
            )


def speed_ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    ratios: dict[str, dict[str, float]] = {}
    for reference in ("full", "h2o"):
        if reference in summaries:
            base = summaries[reference]["tokens_per_s"]
            ratios[f"vs_{reference}"] = {p: s["tokens_per_s"] / base for p, s in summaries.items()}
    return ratios


def speed_targets(results: dict[str, Any], config: SpeedConfig) -> dict[str, Any]:
    """The issue's targets next to what this run measured (reported, never asserted)."""
    policies, ratios = results["policies"], results["ratios"]
    epikv = policies.get("epikv", {})
    return {
        "epikv_scoring_share_pct<=5": epikv.get("end_step_share_pct"),
        "epikv_vs_full_equal_length_pct<=5": epikv.get("vs_full_equal_length_pct"),
        "epikv_speedup_vs_full>=1.5": ratios.get("vs_full", {}).get("epikv"),
        "epikv_speedup_vs_h2o>=2.8": ratios.get("vs_h2o", {}).get("epikv"),
        "peak_within_K_plus_tau": {p: s["within_bound"] for p, s in policies.items()},
        "measured_at": {"budget": config.budget, "tokens": config.tokens, "target_tokens": 8192},
    }


def plot_speed(json_path: str | Path, png: str | Path | None = None) -> Path:
    """Tokens/s against position (left) and per-step time against position (right), per policy."""
    data = documents.read_result(json_path, "speed")
    results, cfg = data["results"], data["config"]
    figure, (left, right) = figures.new_figure(width=10.0, height=4.2, ncols=2)
    for index, (name, summary) in enumerate(results["policies"].items()):
        series, colour = summary["series"], f"C{index}"
        label = f"{name} ({summary['tokens_per_s']:.1f} tok/s)"
        left.plot(series["position"], series["tokens_per_s"], color=colour, label=label)
        right.plot(series["position"], series["step_ms"], color=colour, label=name)
    for axes, ylabel in ((left, "decode tokens/s"), (right, "ms per step")):
        axes.set_xlabel("position (tokens)")
        axes.set_ylabel(ylabel)
        axes.axvline(cfg["budget"], color="grey", linestyle=":", linewidth=1)
    left.legend(fontsize=7)
    left.set_title(f"{results['model']}, K={cfg['budget']}, {cfg['tokens']} forced tokens", fontsize=9)
    right.set_title(
        f"device {cfg['device']}, threads {cfg['threads']}, attention {cfg['attention']}", fontsize=9
    )
    return figures.save_figure(figure, png or figures.png_path(json_path))
