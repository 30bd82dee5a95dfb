"""Counterfactual importance labels by occlusion (paper §1.8), with an injectable answer scorer.

This module owns the labelling protocol: slide a window over a trace's reasoning span, replace its
tokens with a filler (same length), and ask how the answer reacts. Two labels per window:

* ``loglik``: drop in the mean log-likelihood per token of the original answer, teacher-forced after
  the occluded context (no decoding);
* ``flip``: whether the greedily re-decoded answer (at most ``answer_tokens`` tokens) has a different
  final answer. Greedy decoding is the argmax chain, so the same teacher-forced pass tells where the
  re-decoded answer first departs from the original; only windows that cause a departure decode.

Per-token labels combine the windows covering a token: flip by OR, loglik by max (the token's
largest effect; max reduces to OR on binary labels, so the two kinds combine alike).

The model is reached only through :class:`AnswerScorer`, so tests can label with a deterministic
fake; :class:`FunctionScorer` adapts any next-token function. The model-backed scorer with a
reusable prefix cache lives in ``scorer.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from epikv.calibrate.traces import Trace, answer_key

LABELS = ("loglik", "flip")
FILLERS = ("eos", "pad", "random")


class AnswerScorer(Protocol):
    """What labelling needs from a model. ``unchanged`` = length of the prefix of ``context`` that
    equals the clean context last given to ``prepare`` (a hint for prefix caching)."""

    def prepare(self, context: Sequence[int]) -> None: ...

    def teacher_force(
        self, context: Sequence[int], answer: Sequence[int], unchanged: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Log-prob of each answer token given context + the answer before it, and the argmax token at
        each answer position; both (len(answer),)."""
        ...

    def greedy(self, context: Sequence[int], max_new: int, stop: Sequence[int], unchanged: int) -> list[int]:
        """Greedy continuation of ``context`` (stop id included when hit)."""
        ...


class FunctionScorer:
    """An AnswerScorer over a next-token function ``ids -> log-probs (V,)`` (no caching; for tests)."""

    def __init__(self, next_logprobs: Callable[[list[int]], np.ndarray]) -> None:
        self.next_logprobs = next_logprobs

    def prepare(self, context: Sequence[int]) -> None:
        return None

    def teacher_force(
        self, context: Sequence[int], answer: Sequence[int], unchanged: int
    ) -> tuple[np.ndarray, np.ndarray]:
        logp, best = np.zeros(len(answer)), np.zeros(len(answer), dtype=np.int64)
        for j, token in enumerate(answer):
            row = np.asarray(self.next_logprobs([*context, *answer[:j]]))
            logp[j], best[j] = row[token], int(row.argmax())
        return logp, best

    def greedy(self, context: Sequence[int], max_new: int, stop: Sequence[int], unchanged: int) -> list[int]:
        out: list[int] = []
        while len(out) < max_new:
            token = int(np.asarray(self.next_logprobs([*context, *out])).argmax())
            out.append(token)
            if token in stop:
                break
        return out


def windows(span_start: int, span_end: int, window: int, stride: int) -> list[tuple[int, int]]:
    """Windows [lo, hi) of ``window`` tokens every ``stride`` tokens over [span_start, span_end); a last
    window ending at span_end is added when the stride leaves the end uncovered. A span shorter
    than the window gives one window covering it."""
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be >= 1, got window={window}, stride={stride}")
    if span_end <= span_start:
        return []
    if span_end - span_start <= window:
        return [(span_start, span_end)]
    out = [(lo, lo + window) for lo in range(span_start, span_end - window + 1, stride)]
    if out[-1][1] < span_end:
        out.append((span_end - window, span_end))
    return out


def filler_ids(kind: str, length: int, eos_id: int, pad_id: int, vocab_size: int, seed: int) -> list[int]:
    """Filler tokens: ``eos`` or ``pad`` repeated, or ``random`` distinct-draw tokens from the vocabulary."""
    if kind == "eos":
        return [eos_id] * length
    if kind == "pad":
        return [pad_id] * length
    if kind == "random":
        return np.random.default_rng(seed).integers(0, vocab_size, size=length).tolist()
    raise ValueError(f"filler must be one of {FILLERS}, got {kind!r}")


@dataclass(frozen=True)
class LabelSettings:
    """How to label: answer_tokens caps the teacher-forced / re-decoded answer."""

    kind: str = "loglik"
    window: int = 32
    stride: int = 16
    filler: str = "eos"
    answer_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in LABELS:
            raise ValueError(f"label must be one of {LABELS}, got {self.kind!r}")
        if self.filler not in FILLERS:
            raise ValueError(f"filler must be one of {FILLERS}, got {self.filler!r}")
        if self.answer_tokens < 1:
            raise ValueError(f"answer_tokens must be >= 1, got {self.answer_tokens}")


@dataclass
class TraceLabels:
    """Window-level and per-token labels of one trace (tokens = the span [P, answer_start))."""

    windows: list[tuple[int, int]]
    window_drop: np.ndarray  # (n_windows,) loglik drop
    window_flip: np.ndarray | None  # (n_windows,) bool, only for kind == "flip"
    token_drop: np.ndarray  # (span,)
    token_flip: np.ndarray | None  # (span,) bool
    reference: str | None  # the clean re-decoded answer key flips are measured against
    decoded: int  # windows that needed decoding


class Labeller:
    """Labels traces with one scorer and settings; ``decode`` turns answer ids into text."""

    def __init__(
        self,
        scorer: AnswerScorer,
        settings: LabelSettings,
        decode: Callable[[list[int]], str],
        eos: Sequence[int],
        pad_id: int,
        vocab_size: int,
    ) -> None:
        self.scorer, self.settings, self.decode = scorer, settings, decode
        self.eos, self.pad_id, self.vocab_size = list(eos), pad_id, vocab_size

    def answer_ids(self, trace: Trace) -> list[int]:
        """The original answer, capped; with its end-of-sequence token when the model stopped there."""
        answer = trace.output_ids[trace.answer_start - trace.prompt_len :]
        if trace.finished and self.eos:
            answer = [*answer, self.eos[0]]
        return answer[: self.settings.answer_tokens]

    def label(self, trace: Trace, index: int = 0) -> TraceLabels:
        s = self.settings
        context = trace.ids[: trace.answer_start]
        answer = self.answer_ids(trace)
        if not answer:
            raise ValueError(f"trace {trace.id}: empty answer")
        self.scorer.prepare(context)
        original = answer_key(self.decode(answer))
        base_logp, base_best = self.scorer.teacher_force(context, answer, len(context))
        want_flip = s.kind == "flip"
        reference, decoded = (
            self._answer(context, answer, base_best, len(context), original) if want_flip else (None, False)
        )
        spans = windows(*trace.span, s.window, s.stride)
        drops, flips = np.zeros(len(spans)), np.zeros(len(spans), dtype=bool)
        for w, (lo, hi) in enumerate(spans):
            seed = s.seed + 7919 * index + w
            fill = filler_ids(s.filler, hi - lo, self.eos[0], self.pad_id, self.vocab_size, seed)
            occluded = [*context[:lo], *fill, *context[hi:]]
            logp, best = self.scorer.teacher_force(occluded, answer, lo)
            drops[w] = float(base_logp.mean() - logp.mean())
            if want_flip:
                key, did_decode = self._answer(occluded, answer, best, lo, original)
                flips[w], decoded = key != reference, decoded + did_decode
        first, end = trace.span
        return TraceLabels(
            windows=spans,
            window_drop=drops,
            window_flip=flips if want_flip else None,
            token_drop=combine(spans, drops, first, end, "max"),
            token_flip=combine(spans, flips, first, end, "or") if want_flip else None,
            reference=reference,
            decoded=int(decoded),
        )

    def _answer(
        self, context: list[int], answer: list[int], best: np.ndarray, unchanged: int, original: str | None
    ) -> tuple[str | None, bool]:
        """Key of the greedily re-decoded answer, and whether it had to decode.

        Where the teacher-forced argmax equals every original answer token, greedy decoding would
        reproduce the original answer, so its key is the original's and nothing is decoded.
        """
        departs = np.flatnonzero(np.asarray(best) != np.asarray(answer))
        if departs.size == 0:
            return original, False
        j = int(departs[0])
        tail = self.scorer.greedy(
            [*context, *answer[:j]], self.settings.answer_tokens - j, self.eos, unchanged
        )
        return answer_key(self.decode([*answer[:j], *tail])), True


def combine(
    spans: Sequence[tuple[int, int]], values: np.ndarray, first: int, end: int, how: str
) -> np.ndarray:
    """Per-token labels over [first, end) from window values: ``max`` or ``or`` over covering windows."""
    out = np.full(end - first, -np.inf)
    for (lo, hi), value in zip(spans, values, strict=True):
        out[lo - first : hi - first] = np.maximum(out[lo - first : hi - first], float(value))
    out[np.isneginf(out)] = 0.0
    return out > 0 if how == "or" else out
