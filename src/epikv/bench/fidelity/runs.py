"""Model runs of the fidelity study on one batch of prompts: the full cache's references, teacher
forcing through a policy's cache with per-position comparisons, and free running.

Each function is one engine run (:class:`epikv.engine.Engine`) over a batch; the recorder is the
requests' ``on_logits`` and ``on_compaction`` observer. It knows nothing of genres, cells or files
(:mod:`epikv.bench.fidelity.study` plans the study and keeps its results).
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from epikv.bench.shared import stats
from epikv.engine import Engine, Request
from epikv.integration import build_spec
from epikv.spec import CacheSpec


class _Recorder:
    """on_logits (and on_compaction) of one request: keeps log-probabilities, or compares them with
    a reference and records where the kept tokens sit."""

    def __init__(
        self,
        reference: torch.Tensor | None = None,
        trace: list[int] | None = None,
        prompt_tokens: int = 0,
        bins: int = 20,
        every: int = 16,
    ) -> None:
        self.reference, self.trace = reference, trace
        self.prompt_tokens, self.bins, self.every = prompt_tokens, bins, every
        self.logprobs: list[torch.Tensor] = []
        self.agree: list[float] = []
        self.kl: list[float] = []
        self.nll: list[float] = []
        self.full_nll: list[float] = []
        self.evicted: list[bool] = []
        self.kept_counts = np.zeros(bins)
        self.kept_prompt = self.kept_total = 0
        self._last_seen: int | None = None

    def __call__(self, index: int, logits: torch.Tensor, evicted: bool) -> None:
        lp = torch.log_softmax(logits.float(), dim=-1).cpu()
        if self.reference is None:
            self.logprobs.append(lp)
            return
        full = self.reference[index]
        token = self.trace[index]
        self.agree.append(float(int(lp.argmax()) == int(full.argmax())))
        self.kl.append(float((full.exp() * (full - lp)).sum()))
        self.nll.append(float(-lp[token]))
        self.full_nll.append(float(-full[token]))
        self.evicted.append(evicted)

    def on_compaction(self, index: int, positions: torch.Tensor) -> None:
        """Pool the kept positions of every layer and head, at most one compaction per ``every``
        tokens (a tau = 1 policy compacts at every step)."""
        if self._last_seen is not None and index - self._last_seen < self.every:
            return
        self._last_seen = index
        kept = positions.reshape(-1)
        kept = kept[kept >= 0].numpy()
        seen = self.prompt_tokens + index
        if kept.size:
            self.kept_counts += stats.kept_position_histogram([kept], seen, self.bins) * kept.size
            self.kept_prompt += int((kept < self.prompt_tokens).sum())
            self.kept_total += int(kept.size)

    def metrics(self, tail: int) -> dict[str, Any]:
        after = [i for i, e in enumerate(self.evicted) if e]
        first = len(self.agree) - min(tail, len(self.agree))

        def mean(values: list[float], idx: list[int] | None = None) -> float | None:
            picked = values if idx is None else [values[i] for i in idx]
            return statistics.fmean(picked) if picked else None

        tail_idx = list(range(first, len(self.agree)))
        out: dict[str, Any] = {}
        for name, values in (("agreement", self.agree), ("kl", self.kl), ("nll", self.nll)):
            out[name] = mean(values)
            out[f"{name}_after_eviction"] = mean(values, after)
            out[f"{name}_tail"] = mean(values, tail_idx)
        out["full_nll_after_eviction"] = mean(self.full_nll, after)
        out["first_eviction_step"] = after[0] if after else None
        total = self.kept_counts.sum()
        out["kept_histogram"] = (self.kept_counts / total).round(5).tolist() if total else None
        out["kept_prompt_share"] = self.kept_prompt / self.kept_total if self.kept_total else None
        return out


def full_traces(
    model: torch.nn.Module, prompts: list[list[int]], tokens: int, stop: set[int] | None = None
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy full-cache traces, each with the log-probabilities (T, V) that predicted its tokens."""
    return _full(model, [Request(ids, tokens, stop_ids=frozenset(stop or ())) for ids in prompts])


def forced_references(
    model: torch.nn.Module, prompts: list[list[int]], continuations: list[list[int]]
) -> list[tuple[list[int], torch.Tensor]]:
    """The full cache's log-probabilities (T, V) along given continuations (teacher forced)."""
    requests = [Request(ids, len(c), forced=c) for ids, c in zip(prompts, continuations, strict=True)]
    return _full(model, requests)


def _full(model: torch.nn.Module, requests: list[Request]) -> list[tuple[list[int], torch.Tensor]]:
    recorders = [_Recorder() for _ in requests]
    for request, recorder in zip(requests, recorders, strict=True):
        request.on_logits = recorder
    done = Engine(model, build_spec(model, "full")).run(requests)
    return [(c.token_ids, torch.stack(r.logprobs)) for c, r in zip(done, recorders, strict=True)]


def teacher_force(
    model: torch.nn.Module,
    prompts: list[list[int]],
    traces: list[list[int]],
    references: list[torch.Tensor],
    spec: CacheSpec,
    tail: int = 128,
    bins: int = 20,
    every: int = 16,
) -> list[dict[str, Any]]:
    """Feed each trace through ``spec``'s cache; compare every next-token distribution with its
    reference. A prompt the budget cannot hold gets ``{"skipped": reason}``."""
    engine = Engine(model, spec)
    out: list[dict[str, Any]] = [{} for _ in prompts]
    runs = []
    for i, (ids, trace, reference) in enumerate(zip(prompts, traces, references, strict=True)):
        recorder = _Recorder(reference, trace, len(ids), bins, every)
        request = Request(
            ids, len(trace), forced=trace, on_logits=recorder, on_compaction=recorder.on_compaction
        )
        try:
            engine.validate(request)
        except ValueError as err:  # the budget cannot hold this prompt's protected tokens
            out[i] = {"skipped": str(err)}
            continue
        runs.append((i, request, recorder))
    done = engine.run([request for _, request, _ in runs])
    for (i, _, recorder), completion in zip(runs, done, strict=True):
        out[i] = recorder.metrics(tail)
        out[i].update(
            peak_cache_tokens=completion.peak_cache_tokens,
            mean_cache_tokens=completion.mean_cache_tokens,
            compactions=completion.compactions,
        )
    return out


def free_run(
    model: torch.nn.Module, prompts: list[list[int]], tokens: int, spec: CacheSpec
) -> list[list[int]]:
    """``tokens`` greedy tokens generated under ``spec`` for each prompt (EOS ignored)."""
    return [c.token_ids for c in Engine(model, spec).run([Request(ids, tokens) for ids in prompts])]
