from __future__ import annotations

import random

import pytest

from epikv.eval.loops import LoopConfig, detect_loop, periodic_tail_span

SMALL = LoopConfig(min_span=12, min_repeats=3, max_period=16)


def _prefix(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 2000) for _ in range(n)]


def test_periodic_tail_span_counts_the_whole_periodic_suffix() -> None:
    assert periodic_tail_span([9, 1, 2, 1, 2, 1, 2], 2) == 6
    assert periodic_tail_span([1, 2, 3], 1) == 1
    assert periodic_tail_span([1, 2], 3) == 0


def test_detects_a_period_five_loop_and_its_onset() -> None:
    prefix = _prefix(40)
    tokens = prefix + [1, 2, 3, 4, 5] * 6
    loop = detect_loop(tokens, SMALL)
    assert loop is not None
    assert (loop.onset, loop.period, loop.span) == (40, 5, 30)


def test_partial_final_period_is_part_of_the_loop() -> None:
    tokens = _prefix(10) + [7, 8, 9] * 5 + [7, 8]
    loop = detect_loop(tokens, SMALL)
    assert loop is not None
    assert (loop.onset, loop.period) == (10, 3)


def test_single_token_run() -> None:
    loop = detect_loop(_prefix(5) + [0] * 20, SMALL)
    assert loop is not None
    assert (loop.onset, loop.period) == (5, 1)


def test_no_loop_in_random_tokens_or_short_repeats() -> None:
    assert detect_loop(_prefix(500), SMALL) is None
    # Three repeats of period 3 cover 9 < min_span tokens.
    assert detect_loop(_prefix(20) + [1, 2, 3] * 3, SMALL) is None
    # Two repeats of a long period are below min_repeats.
    block = _prefix(10, seed=1)
    assert detect_loop(_prefix(20) + block * 2, SMALL) is None


def test_loop_escaped_before_the_end_is_not_reported() -> None:
    tokens = _prefix(10) + [1, 2] * 20 + _prefix(10, seed=2)
    assert detect_loop(tokens, SMALL) is None


def test_default_thresholds_on_a_long_generation() -> None:
    tokens = _prefix(3000) + _prefix(100, seed=3) * 5
    loop = detect_loop(tokens)
    assert loop is not None
    assert (loop.onset, loop.period) == (3000, 100)


@pytest.mark.parametrize("kwargs", [{"min_span": 1}, {"min_repeats": 1}, {"max_period": 0}])
def test_config_rejects_bad_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LoopConfig(**kwargs)
