"""Pure checks on generated token ids: does a generation end in a repetition loop, and where do
two generations of the same prompt part? The project's one home for both (issue 28).

Two loop detectors, both on the tail only (a loop the model escaped from is not a loop here):
``detect_loop``, the exact one: the tail repeats token for token with some period p, over a span
long enough to be a loop rather than a repeated phrase; and ``detect_near_loop``, the same test after
every run of number tokens is replaced by one placeholder, so a line repeated with a number that
changes each time ("1 - 16 = ...", "1 - 17 = ...") counts too. Looping to the length cap is the main
way eviction costs accuracy (paper §1.7), so each example records whether and where a loop began.

Two divergences with different meanings about a prefix: ``first_divergence`` (a generation that
stops while the other goes on parts from it where it stops) and ``first_mismatch`` (only tokens both
have are compared: a prefix of the reference never mismatches it). Nothing here knows a model; the
number tokens come from :func:`number_token_ids`, given a tokenizer.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoopConfig:
    """Thresholds for `detect_loop`.

    min_span: the periodic tail must cover at least this many tokens.
    min_repeats: and hold at least this many full periods.
    max_period: longest period searched.
    """

    min_span: int = 256
    min_repeats: int = 3
    max_period: int = 1024

    def __post_init__(self) -> None:
        if self.min_span < 2:
            raise ValueError(f"min_span must be >= 2, got {self.min_span}")
        if self.min_repeats < 2:
            raise ValueError(f"min_repeats must be >= 2, got {self.min_repeats}")
        if self.max_period < 1:
            raise ValueError(f"max_period must be >= 1, got {self.max_period}")


@dataclass(frozen=True)
class Loop:
    """A periodic tail: `token_ids[onset:]` repeats with period `period`."""

    onset: int
    period: int
    span: int


def periodic_tail_span(token_ids: Sequence[int], period: int) -> int:
    """Length of the longest suffix of `token_ids` that has period `period` (0 if shorter than one period).

    A suffix has period p when every token equals the token p positions earlier within it.
    """
    n = len(token_ids)
    if period < 1 or n < period:
        return 0
    j = n - 1
    while j - period >= 0 and token_ids[j] == token_ids[j - period]:
        j -= 1
    # Positions j+1 .. n-1 match their predecessor one period back, so the suffix starting at
    # j + 1 - period is periodic.
    return n - (j + 1 - period)


def detect_loop(token_ids: Sequence[int], config: LoopConfig | None = None) -> Loop | None:
    """The longest qualifying periodic tail of `token_ids`, or None.

    Among periods 1..max_period whose tail covers >= min_span tokens and >= min_repeats periods,
    returns the one with the earliest onset (ties: the smallest period). Cost is linear in the sum
    of the tails' spans, so a non-looping sequence is cheap.
    """
    cfg = config or LoopConfig()
    best: Loop | None = None
    for period in range(1, min(cfg.max_period, len(token_ids)) + 1):
        span = periodic_tail_span(token_ids, period)
        if span < cfg.min_span or span < cfg.min_repeats * period:
            continue
        if best is None or span > best.span:
            best = Loop(onset=len(token_ids) - span, period=period, span=span)
    return best


def shortest_loop_period(token_ids: Sequence[int], config: LoopConfig | None = None) -> int | None:
    """The smallest period whose tail qualifies as a loop under ``config`` (the same rule as
    :func:`detect_loop`, which reports the longest tail instead), or None. The fidelity study's
    report of a free run's loop."""
    cfg = config or LoopConfig()
    for period in range(1, min(cfg.max_period, len(token_ids)) + 1):
        span = periodic_tail_span(token_ids, period)
        if span >= cfg.min_span and span >= cfg.min_repeats * period:
            return period
    return None


NUMBER = -1  # the placeholder of a run of number tokens (token ids are >= 0)


def collapse_numbers(token_ids: Sequence[int], number_ids: Collection[int]) -> tuple[list[int], list[int]]:
    """``token_ids`` with every maximal run of tokens in ``number_ids`` replaced by one
    :data:`NUMBER`, and for each symbol of the result the index of its first token in ``token_ids``."""
    symbols: list[int] = []
    starts: list[int] = []
    for index, token in enumerate(token_ids):
        if token in number_ids:
            if symbols and symbols[-1] == NUMBER:
                continue
            token = NUMBER
        symbols.append(token)
        starts.append(index)
    return symbols, starts


def detect_near_loop(
    token_ids: Sequence[int], number_ids: Collection[int], config: LoopConfig | None = None
) -> Loop | None:
    """The longest loop of :func:`detect_loop` once numbers are ignored, or None.

    Every maximal run of ``number_ids`` tokens becomes one placeholder (so "9" and "10" are the
    same symbol), and the exact rule runs on the result: a periodic tail of at least
    ``min_repeats`` periods, a period of at most ``max_period`` symbols, covering at least
    ``min_span`` tokens of ``token_ids``. ``onset`` and ``span`` are in tokens of ``token_ids``,
    ``period`` in symbols. With no number tokens it is :func:`detect_loop`. A tail made of digits
    alone is one number here, so it is not a loop (the exact detector calls "0000..." one)."""
    cfg = config or LoopConfig()
    symbols, starts = collapse_numbers(token_ids, number_ids)
    best: Loop | None = None
    for period in range(1, min(cfg.max_period, len(symbols)) + 1):
        span = periodic_tail_span(symbols, period)
        if span < cfg.min_repeats * period:
            continue
        onset = starts[len(symbols) - span]
        if len(token_ids) - onset < cfg.min_span:
            continue
        if best is None or onset < best.onset:
            best = Loop(onset=onset, period=period, span=len(token_ids) - onset)
    return best


def number_token_ids(tokenizer: Any, vocab_size: int | None = None) -> frozenset[int]:
    """The ids whose text is one or more ASCII digits (leading or trailing spaces allowed): the
    tokens :func:`detect_near_loop` treats as parts of numbers."""
    size = vocab_size or (len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size)
    found = set()
    for token in range(size):
        text = tokenizer.decode([token]).strip()
        if text and text.isascii() and text.isdigit():
            found.add(token)
    return frozenset(found)


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` leaves ``reference``, None when they are equal. A
    generation that stops while the other goes on diverges where the shorter one ends (the loop
    study: two free-running generations of the same problem)."""
    for index, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return index
    return None if len(reference) == len(other) else min(len(reference), len(other))


def first_mismatch(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first differing token among those both have, None when there is none: unlike
    :func:`first_divergence`, a sequence never mismatches its own prefix (the fidelity study: a free
    run, cut to the length of the reference trace, against that trace)."""
    for index, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return index
    return None
