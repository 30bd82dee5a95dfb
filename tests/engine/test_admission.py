"""The gate: one call says whether a request can ever run, with one error family naming the field."""

from __future__ import annotations

import pytest

from epikv.engine import (
    Admission,
    AdmissionError,
    BudgetOutOfRange,
    Engine,
    PoolTooSmall,
    PromptTooLong,
    QueueFull,
    Request,
    SchedulerLimits,
    prompt_fit,
)
from epikv.integration import build_spec
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec, precheck

INFO = ModelInfo("hand", num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)


def flat(budget: int = 64) -> CacheSpec:
    return CacheSpec.build(INFO, "epikv-flat", budget, interval=8, params={"band_a": 1, "band_b": 2})


def request(prompt: int, new: int = 10, budget: int | None = None) -> Request:
    return Request(list(range(1, prompt + 1)), new, budget=budget)


def test_what_fits_gets_its_reservation():
    gate = Admission(flat(), context_length=512, window_slots=7, kv_pool=1000)
    assert gate.check(request(10, 10)) == 20 + 7  # never reaches K: prompt + new, plus the rings
    assert gate.check(request(10, 500)) == 64 + 8 + 7  # K + tau, plus the rings
    assert gate.check(request(10, 500, budget=32)) == 32 + 8 + 7  # its own K


@pytest.mark.parametrize(
    "gate, asked, error, field",
    [
        (Admission(flat()), request(10, budget=65), BudgetOutOfRange, "budget"),
        (Admission(flat()), request(10, budget=0), BudgetOutOfRange, "budget"),
        (Admission(flat(), context_length=100), request(101), PromptTooLong, "prompt"),
        (Admission(flat(), kv_pool=50), request(10, 500), PoolTooSmall, "max_new_tokens"),
    ],
)
def test_every_refusal_is_one_family_naming_its_field(gate, asked, error, field):
    with pytest.raises(error) as refused:
        gate.check(asked)
    assert isinstance(refused.value, AdmissionError) and isinstance(refused.value, ValueError)
    assert refused.value.field == field and str(refused.value)


def test_a_full_cache_refuses_a_request_budget():
    full = CacheSpec.build(INFO, "full", None)
    with pytest.raises(BudgetOutOfRange, match="keeps every token"):
        Admission(full).check(request(10, budget=8))
    assert Admission(full).check(request(10, 30)) == 40


def test_a_prompt_past_its_k_reserves_at_the_smallest_k_that_holds_it():
    """Issue 42 item 0: K 64 cannot hold a 60-token prompt and its recent window (60 + 16); K 79 can
    (60 + 79 // 4 = 79; 78 cannot: 60 + 19 > 78), so the request runs at 79 and reserves 79 + tau."""
    spec = flat()
    assert spec.prompt_budget(60) == 79
    assert Admission(spec).check(request(60, 500)) == 79 + 8
    assert Admission(spec).check(request(60, 10)) == 70  # never reaches its K
    assert Admission(spec).check(request(60, 500, budget=16)) == 79 + 8  # its own K is raised too
    fit = prompt_fit(spec, None, 60)  # the strict rule (epikv eval's) still refuses it at K
    assert fit.min_budget == 79 and "the smallest budget that holds them is 79" in (fit.problem or "")


def test_submit_asks_the_gate_once_and_the_queue_keeps_the_answer(tiny_llama, monkeypatch):
    spec = build_spec(tiny_llama, "streaming", 16, interval=4)
    engine = Engine(tiny_llama, spec, SchedulerLimits(kv_pool=50, max_waiting=0))
    calls = []
    check = engine.admission.check
    monkeypatch.setattr(engine, "admission", _Counting(check, calls))
    engine.submit(request(5, 12))
    assert calls == [1] and engine.scheduler.waiting[0][1] == 17 + engine.admission.window_slots
    engine.step()
    assert calls == [1] and engine.running == 1 and engine.reserved_slots == engine.rows[0].slots
    engine.submit(request(5, 12))  # two rows of 17 slots fit the pool: it does not wait
    with pytest.raises(QueueFull):
        engine.submit(request(5, 12))  # a third would wait (3 x 17 > 50), and none may


def test_the_command_lines_precheck_before_any_model():
    assert precheck("epikv", "256", ["band_a=1"]) == 256
    assert precheck("full", "nonsense") is None  # the full cache needs no budget, whatever is asked
    with pytest.raises(ValueError, match="budget must be a positive number"):
        precheck("h2o", "0")
    with pytest.raises(ValueError, match="unknown parameter 'bnad_a'; did you mean 'band_a'"):
        precheck("epikv", "256", ["bnad_a=1"])


class _Counting:
    def __init__(self, check, calls: list[int]) -> None:
        self._check, self.calls = check, calls
        self.window_slots = check.__self__.window_slots

    def check(self, asked: Request) -> int:
        self.calls.append(1)
        return self._check(asked)
