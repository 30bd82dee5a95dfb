"""The threads rule of generate, eval and serve (epikv.threads): the cores nobody else is using."""

from __future__ import annotations

import pytest
import torch

from epikv.threads import apply_threads, auto_threads, parse_threads


@pytest.mark.parametrize(
    "cores, load, threads",
    [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.3, 1), (2, 7.0, 1), (16, 3.6, 12), (4, -1.0, 4)],
)
def test_auto_gives_the_cores_not_busy(cores, load, threads):
    assert auto_threads(cores, load) == threads


@pytest.mark.parametrize("value, parsed", [("auto", None), ("AUTO", None), (None, None), ("3", 3), (2, 2)])
def test_parse(value, parsed):
    assert parse_threads(value) == parsed


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_bad_values_name_themselves(value):
    with pytest.raises(ValueError, match=f"got {value!r}"):
        parse_threads(value)


def test_apply_sets_torch_and_says_why(monkeypatch):
    assert apply_threads("2") == "threads 2 (--threads)" and torch.get_num_threads() == 2
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.getloadavg", lambda: (1.2, 0.0, 0.0))
    line = apply_threads("auto")
    assert torch.get_num_threads() == 1 and line.startswith("threads 1 (auto: 2 cores, load 1.2")
