"""The engine: a request added while others run yields exactly what it yields alone."""

from __future__ import annotations

import pytest
import torch

from epikv.engine import Engine, Request, SamplingParams, SchedulerLimits
from epikv.integration import build_spec
from epikv.policies import policy_names
from tests.helpers.engine import FLOAT_SENSITIVE, Logits, prompts, spec_for

REQUIRED = ["full", "streaming", "epikv-flat", "epikv", "h2o"]  # the exactness set


def staggered(model, spec, requests: list[Request], joins: dict[int, int]) -> dict[int, object]:
    """Request 0 starts at once; request i joins before decode step ``joins[i]``."""
    engine, done = Engine(model, spec), {}
    with engine:
        engine.add(requests[0])
        step = 0
        while engine.has_work() or len(done) + engine.running < len(requests):
            for index, at in joins.items():
                if at == step:
                    engine.add(requests[index])
            for completion in engine.step():
                done[completion.request_id] = completion
            step += 1
    assert engine.cache.batch_size == 0 and engine.reserved_slots == 0
    return done


def alone(model, spec, request: Request):
    return Engine(model, spec).run([request])[0]


def compare(model, name: str, sampling: SamplingParams | None = None) -> None:
    spec = spec_for(model, name)
    lengths = [70, 63, 56, 49]  # rows finish at different steps
    make = lambda i, p: Request(p, lengths[i], sampling or SamplingParams(), on_logits=Logits())  # noqa: E731
    batch = [make(i, p) for i, p in enumerate(prompts())]
    done = staggered(model, spec, batch, {1: 3, 2: 10, 3: 17})
    for i, prompt in enumerate(prompts()):
        reference = make(i, prompt)
        want, got = alone(model, spec, reference), done[batch[i].id]
        bound = spec.peak_tokens(len(prompt), lengths[i])
        assert got.peak_cache_tokens <= bound and len(got.token_ids) == lengths[i]
        if name in FLOAT_SENSITIVE:
            first = reference.on_logits.evicted.index(True)
            for a, b in zip(reference.on_logits.rows[:first], batch[i].on_logits.rows[:first], strict=True):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            continue
        assert got.token_ids == want.token_ids, (name, i)
        assert (got.peak_cache_tokens, got.final_cache_tokens, got.evictions, got.compactions) == (
            want.peak_cache_tokens,
            want.final_cache_tokens,
            want.evictions,
            want.compactions,
        ), (name, i)
        assert got.first_evicted_index == want.first_evicted_index


@pytest.mark.exactness
@pytest.mark.parametrize("name", REQUIRED)
def test_added_mid_generation_yields_what_it_yields_alone(arch_model, name):
    compare(arch_model, name)


@pytest.mark.parametrize("name", sorted(set(policy_names()) - {"full", "streaming", "epikv-flat", "h2o"}))
def test_every_policy_splices_rows(tiny_llama, name):
    """The row protocol of every registered policy: take rows out, splice rows in, exactly."""
    compare(tiny_llama, name)


def test_seeded_sampling_is_the_same_in_any_batch(tiny_llama):
    compare(tiny_llama, "epikv", SamplingParams(temperature=0.8, top_p=0.9, seed=7))


def test_stops_cancel_and_leave_without_disturbing_others(tiny_llama):
    spec = spec_for(tiny_llama, "epikv-flat", budget=28)
    ps = prompts()
    eos = alone(tiny_llama, spec, Request(ps[1], 40)).token_ids[9]
    requests = [
        Request(ps[0], 40),
        Request(ps[1], 40, stop_ids=frozenset({eos})),  # stops early at its own token
        Request(ps[2], 40, on_token=lambda token: False),
        Request(ps[3], 40),
    ]
    engine, done = Engine(tiny_llama, spec), {}
    for request in requests:
        engine.add(request)
    for step in range(60):
        if step == 5:
            cancelled = engine.finish(requests[2].id)
            assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) == 6
        for completion in engine.step():
            done[completion.request_id] = completion
    assert done[requests[1].id].finish_reason == "eos" and done[requests[1].id].token_ids[-1] == eos
    for request in (requests[0], requests[3]):
        assert (
            done[request.id].token_ids == alone(tiny_llama, spec, Request(request.prompt_ids, 40)).token_ids
        )
    assert engine.cache.batch_size == 0 and not engine.has_work()


def test_on_token_can_stop_a_request(tiny_llama):
    spec = spec_for(tiny_llama, "streaming")
    seen: list[int] = []
    stop_after = 4

    def on_token(token: int) -> bool:
        seen.append(token)
        return len(seen) == stop_after

    completion = Engine(tiny_llama, spec).run([Request(prompts()[0], 30, on_token=on_token)])[0]
    assert completion.finish_reason == "stop" and completion.token_ids == seen and len(seen) == stop_after


def test_a_request_budget_narrows_the_engines(tiny_llama):
    spec = spec_for(tiny_llama, "streaming", budget=40)
    narrow = Request(prompts()[0], 50, budget=20)
    wide = Request(prompts()[1], 50)
    out = Engine(tiny_llama, spec).run([narrow, wide])
    assert out[0].peak_cache_tokens == 21 and out[0].final_cache_tokens == 20
    assert out[1].peak_cache_tokens == 41 and out[1].final_cache_tokens == 40
    with pytest.raises(ValueError, match="at most the engine's"):
        Engine(tiny_llama, spec).add(Request(prompts()[0], 5, budget=41))


def test_admission_holds_the_pool(tiny_llama):
    """With a pool of 2.5 requests' worth of slots, two run at once and the rest wait in order."""
    spec = spec_for(tiny_llama, "streaming", budget=24)
    per_request = spec.peak_tokens(20, 30)  # K + tau = 25
    engine = Engine(tiny_llama, spec, SchedulerLimits(kv_pool=int(per_request * 2.5)))
    requests = [Request(p, 30) for p in prompts() + prompts(seed=1)]
    for request in requests:
        engine.submit(request)
    running, order = [], []
    while engine.has_work():
        order += [c.request_id for c in engine.step()]
        running.append(engine.running)
        assert engine.reserved_slots <= engine.scheduler.limits.kv_pool
    assert max(running) == 2 and order == [r.id for r in requests]
    with pytest.raises(ValueError, match="the whole KV pool holds"):
        Engine(tiny_llama, build_spec(tiny_llama, "full"), SchedulerLimits(kv_pool=30)).submit(
            Request(prompts()[0], 30)
        )


def test_prefix_request_equals_the_whole_prompt(tiny_llama):
    engine = Engine(tiny_llama, build_spec(tiny_llama, "full"))
    whole = prompts()[2]
    clean = engine.runner.new_cache()
    engine.runner.prefill(clean, whole)
    resumed = Request(whole[12:], 20, prefix=clean, prefix_length=12)
    assert engine.run([resumed])[0].token_ids == alone(tiny_llama, engine.spec, Request(whole, 20)).token_ids
    assert clean.held == [len(whole)]  # the prefix's cache was never written
