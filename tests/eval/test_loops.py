from __future__ import annotations

import random

import pytest

from epikv.eval.loops import (
    NUMBER,
    LoopConfig,
    collapse_numbers,
    detect_loop,
    detect_near_loop,
    first_divergence,
    first_mismatch,
    number_token_ids,
    periodic_tail_span,
    shortest_loop_period,
)

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


# --------------------------------------------------------------------------- the near-periodic detector

DIGITS = frozenset(range(10))  # token i < 10 is the digit i here; words are tokens >= 100


def _number(value: int) -> list[int]:
    return [int(d) for d in str(value)]


def _counting_lines(start: int, count: int) -> list[int]:
    """Lines "<n> - <n + 7> = <n * 3> apples ." whose numbers change every line (and grow a digit)."""
    out: list[int] = []
    for n in range(start, start + count):
        out += [*_number(n), 101, *_number(n + 7), 102, *_number(3 * n), 103, 104, 105]
    return out


def test_near_loop_is_the_exact_loop_when_nothing_is_a_number() -> None:
    rng = random.Random(4)
    for _ in range(200):
        tokens = [rng.randrange(10, 14) for _ in range(rng.randrange(0, 40))]
        tokens += [rng.randrange(10, 14) for _ in range(rng.randrange(1, 4))] * rng.randrange(0, 8)
        assert detect_near_loop(tokens, frozenset(), SMALL) == detect_loop(tokens, SMALL)


def test_near_loop_finds_an_exact_loop_at_the_same_onset() -> None:
    tokens = _prefix(40) + [1, 2, 100, 101, 102] * 6
    exact, near = detect_loop(tokens, SMALL), detect_near_loop(tokens, DIGITS, SMALL)
    assert exact is not None and near is not None
    assert (near.onset, near.span) == (exact.onset, exact.span) == (40, 30)
    assert near.period == 4  # "1 2" is one number: 4 symbols per period
    # A number across the period's edge ("5" then "1 2") is one symbol too: 3 symbols per period.
    near = detect_near_loop(_prefix(40) + [1, 2, 100, 101, 5] * 6, DIGITS, SMALL)
    assert near is not None and (near.onset, near.period) == (40, 3)


def test_near_loop_tolerates_numbers_that_change_every_line() -> None:
    tokens = _prefix(30) + _counting_lines(95, 8)  # 95 .. 102: the numbers grow a digit midway
    assert detect_loop(tokens, SMALL) is None
    near = detect_near_loop(tokens, DIGITS, SMALL)
    assert near is not None
    assert (near.onset, near.period) == (30, 8)
    assert near.span == len(tokens) - 30


def test_near_loop_needs_the_words_to_repeat() -> None:
    assert detect_near_loop(_prefix(500), DIGITS, SMALL) is None
    words = [100 + (i % 7) * (i % 5) for i in range(60)]  # aperiodic words around the same numbers
    tokens: list[int] = []
    for i, word in enumerate(words):
        tokens += [*_number(i), word]
    assert detect_near_loop(tokens, DIGITS, SMALL) is None
    # Escaped before the end, and too few periods, as for the exact detector.
    assert detect_near_loop(_counting_lines(1, 8) + _prefix(10, seed=5), DIGITS, SMALL) is None
    assert detect_near_loop(_prefix(20) + _counting_lines(1, 2), DIGITS, SMALL) is None


def test_near_loop_measures_the_span_in_tokens() -> None:
    # Three periods of 2 symbols are 6 symbols but 3 * (4 + 1) = 15 tokens: enough for min_span 12.
    tokens = _prefix(10) + [1, 2, 3, 4, 100] * 3
    near = detect_near_loop(tokens, DIGITS, SMALL)
    assert near is not None and (near.onset, near.span) == (10, 15)
    assert detect_near_loop(_prefix(10) + [1, 100] * 3, DIGITS, SMALL) is None  # 6 tokens < 12


def test_a_tail_of_digits_alone_is_one_number() -> None:
    tokens = _prefix(10) + [0] * 20
    assert detect_loop(tokens, SMALL) is not None
    assert detect_near_loop(tokens, DIGITS, SMALL) is None


def test_collapse_numbers_keeps_where_each_symbol_starts() -> None:
    assert collapse_numbers([100, 1, 2, 101, 3, 100], DIGITS) == (
        [100, NUMBER, 101, NUMBER, 100],
        [0, 1, 3, 4, 5],
    )


def test_number_token_ids_reads_the_vocabulary() -> None:
    class Vocab:
        texts = ("a", "7", " 12", "1.5", "²", "", "x9")

        def __len__(self) -> int:
            return len(self.texts)

        def decode(self, ids: list[int]) -> str:
            return self.texts[ids[0]]

    assert number_token_ids(Vocab()) == frozenset({1, 2})


# --------------------------------------------------------------------------- other loop rules, divergence


def test_shortest_loop_period() -> None:
    config = LoopConfig(min_span=16, min_repeats=3, max_period=8)
    assert shortest_loop_period([5, 6, 7] + [1, 2] * 20, config) == 2
    assert shortest_loop_period([9] * 40, LoopConfig(min_span=16, max_period=64)) == 1
    assert shortest_loop_period(list(range(60)), LoopConfig(min_span=16, max_period=64)) is None
    assert shortest_loop_period([1, 2] * 4, LoopConfig(min_span=16, max_period=64)) is None  # too short
    # detect_loop reports the longest tail (period 17 reaches further back), this the smallest period.
    tokens = _prefix(5) + ([1, 2] * 8 + [9]) * 3 + [1, 2] * 8
    wide = LoopConfig(min_span=16, min_repeats=3, max_period=20)
    assert shortest_loop_period(tokens, wide) == 2
    loop = detect_loop(tokens, wide)
    assert loop is not None and (loop.onset, loop.period) == (5, 17)


def test_first_divergence_counts_a_generation_that_stops_early() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # stopped (EOS) where the other went on
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_first_mismatch_compares_only_the_tokens_both_have() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 4]) == 2
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 2]) is None  # a prefix: where first_divergence says 2
