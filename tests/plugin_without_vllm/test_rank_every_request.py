"""A request's own rho (``extra_args["epikv_rank_every"]``, issue 56) in the plugin, without vLLM:
the one request rule (:func:`epikv.vllm.config.plan_request`) takes it only on a server that evicts
at tau = 1, where its reservation stays the K + 1 it has without it, and refuses it elsewhere in one
line naming it; in the worker step a row keeps exactly the sets it keeps on a server that ranks (or
not) every request alike, whatever the other rows of its batch do."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from epikv.errors import AdmissionError
from epikv.vllm.config import RANK_EVERY_ARG, EpiKVSettings, RequestPlan, plan_request, request_rank_every
from epikv.vllm.plugin import _field
from epikv.vllm.step import EpiKVWorkerState, NewRequest
from tests.plugin_without_vllm import test_rank_every_step as ranked_step

MODEL = ranked_step.MODEL


def spec(policy: str = "keydiff", interval: int | None = 1, rank_every: int | None = None):
    return EpiKVSettings(policy, 64 if policy != "full" else None, interval, rank_every=rank_every).spec(
        MODEL
    )


@pytest.mark.parametrize("server", [None, 8])
def test_a_requests_rho_is_its_own_and_reserves_what_it_reserves_without_it(server):
    s = spec(rank_every=server)
    assert request_rank_every(s, None) == request_rank_every(s, {}) == server  # absent: the server's
    for raw in (4, "4"):
        assert request_rank_every(s, {RANK_EVERY_ARG: raw}) == 4
        assert plan_request(s, 10, 500, {RANK_EVERY_ARG: raw}) == RequestPlan(64, 65, 65)
    assert plan_request(s, 10, 20, {RANK_EVERY_ARG: 1, "epikv_budget": 32}) == RequestPlan(32, 33, 30)


def refusal(s, raw) -> AdmissionError:
    with pytest.raises(AdmissionError) as err:
        plan_request(s, 10, 500, {RANK_EVERY_ARG: raw})
    line = str(err.value)
    assert err.value.field == "rank_every" and "\n" not in line
    assert line.startswith(f"{RANK_EVERY_ARG}={raw!r}: "), line
    return err.value


@pytest.mark.parametrize("raw", [0, -3, "four", True, 2.5])
def test_a_bad_rho_is_refused_in_one_line_naming_the_field(raw):
    assert "positive number of decode steps" in str(refusal(spec(), raw))


def test_a_rho_is_refused_where_the_server_compacts_at_an_interval_or_never_evicts():
    assert "needs interval 1, got interval=16" in str(refusal(spec(interval=16), 4))
    assert "needs interval 1, got interval=128" in str(refusal(spec("epikv", None), 4))  # Seg-Q's own tau
    assert "'full' keeps every token" in str(refusal(spec("full", None), 4))


def test_the_front_end_names_the_request_field_and_its_value():
    params = SimpleNamespace(extra_args={RANK_EVERY_ARG: 0}, max_tokens=9)
    err = refusal(spec(interval=16), 0)
    assert _field(err.field, params, 10) == (RANK_EVERY_ARG, 0)


def test_the_worker_faults_a_request_whose_rho_the_rule_refuses():
    """Inputs that bypass the front end: the worker's plan refuses them by the same rule, that
    request alone, with the same line."""
    settings = EpiKVSettings("keydiff", 64, 16)
    state = EpiKVWorkerState(settings, settings.spec(MODEL), MODEL)
    state.after_update([NewRequest("rho", 10, 0, 20, {RANK_EVERY_ARG: 4}), NewRequest("ok", 10, 0, 20, None)])
    faults = state.take()[1]
    assert list(faults) == ["rho"] and re.search(r"epikv_rank_every=4: .*interval=16", faults["rho"])
    assert list(state.requests.records) == ["ok"]


@pytest.mark.parametrize(
    ("server", "extra", "alike"),
    [
        # a tau = 1 server that scores at every eviction: a and c rank every 4 steps, b does not
        (None, {"a": 4, "c": 4}, {"a": 4, "b": None, "c": 4}),
        # a server that ranks every 4 steps: b asks for rho = 1, which is tau = 1 exactly
        (4, {"b": 1}, {"a": 4, "b": None, "c": 4}),
    ],
)
@pytest.mark.parametrize("policy", ["keydiff", "random"])
def test_each_row_of_a_mixed_batch_keeps_what_it_keeps_on_a_server_that_ranks_all_alike(
    policy, server, extra, alike, monkeypatch
):
    """Each row's held sets after every step, its score calls and its counters equal those of the
    same request on a server whose own rank_every is the row's (4, or None at tau = 1)."""
    settings = ranked_step.settings_for(policy, server)
    args = {r: {RANK_EVERY_ARG: rho} for r, rho in extra.items()}
    got = ranked_step.run(policy, server, monkeypatch, extra=args, settings=settings)
    want = {rho: ranked_step.run(policy, rho, monkeypatch) for rho in set(alike.values())}
    assert want[4]["a"]["held"] != want[None]["a"]["held"]  # the two rules keep different sets here
    for r, rho in alike.items():
        assert got[r]["held"] == want[rho][r]["held"], r
        assert got[r]["report"] == want[rho][r]["report"], r
        calls = [(s, p.tolist()) for s, p, _ in got[r]["scores"]]
        assert calls == [(s, p.tolist()) for s, p, _ in want[rho][r]["scores"]], r
