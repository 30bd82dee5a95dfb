from __future__ import annotations

from typing import Any

import pytest

from epikv.eval.config import EvalConfig
from epikv.eval.generator import generator_factory, make_sampling


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


def test_a_runs_factory_binds_its_interval_and_parameters() -> None:
    built: list[tuple[Any, ...]] = []

    def engine(policy: str, budget: int | None, interval: int | None, params: dict[str, Any]) -> Any:
        built.append((policy, budget, interval, params))
        return "generator"

    config = EvalConfig("gsm8k", "h2o", 64, interval=8, policy_params={"recent": 4})
    assert generator_factory(engine, config)("h2o", 32) == "generator"
    assert built == [("h2o", 32, 8, {"recent": 4})]
