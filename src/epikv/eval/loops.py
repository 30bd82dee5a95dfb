"""Detecting a generation that ends in a repetition loop.

Owns one pure check on token ids: does the tail of the sequence repeat with some period p, over a
span long enough to be a loop rather than a repeated phrase? Looping to the length cap is the main
way eviction costs accuracy (paper §1.7), so each example records whether and where a loop began.
Only the tail is examined: a loop the model escaped from is not a loop here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
