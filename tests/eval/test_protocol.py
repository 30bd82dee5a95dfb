from __future__ import annotations

import sys

import pytest

from epikv.eval.protocol import make_sampling


def test_sampling_uses_the_engine_class_when_present() -> None:
    generation = pytest.importorskip("epikv.generation")
    sampling = make_sampling(max_new_tokens=8192, temperature=0.6, top_p=0.95, seed=3)
    assert isinstance(sampling, generation.SamplingConfig)
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (
        8192,
        0.6,
        0.95,
        3,
    )
    assert sampling.ignore_eos is False


def test_sampling_falls_back_when_the_engine_module_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "epikv.generation", None)  # makes the import fail as if missing
    sampling = make_sampling(max_new_tokens=16, temperature=0.0, top_p=1.0, seed=0)
    assert type(sampling).__name__ == "_LocalSampling"
    assert (sampling.max_new_tokens, sampling.ignore_eos) == (16, False)
