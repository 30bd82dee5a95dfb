"""The plugin under an operator's traffic (in-process engine, float32, eager): requests joining and
aborted mid-run, a forced preemption, per-request budgets, long prompts, reservation admission,
stop strings, and faults. Each request that goes wrong fails alone; the others give their solo
tokens; the engine serves afterwards; no per-request entry outlives its request. Each check compares
the engine with its own solo tokens or its counters with hand-computed ones, so the model is epikv's
tiny Llama with the embedded model's vocabulary (``conftest.tiny["served"]``, 4,096 positions), not
the 30-layer embedded model.

Tests that build their own engine come last: closing an engine tears down vLLM's process-wide groups,
so the module's engine is not used after one."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.utils.math_utils import cdiv

import epikv.vllm
from epikv.vllm.config import BUDGET_ARG
from tests.vllm.engines import (
    assert_nothing_left,
    close,
    core,
    drive,
    generate,
    make_llm,
    params,
    tokens,
    worker_state,
)

K = 48  # streaming: every step over K evicts one token
BLOCKS = 200  # the module engine's pool, in blocks of 32


@pytest.fixture(scope="module")
def llm(tiny):
    llm = make_llm(tiny["served"], num_gpu_blocks_override=BLOCKS, **epikv.vllm.engine_kwargs("streaming", K))
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def solo(llm, embedded):
    """Each prompt's tokens alone, 80 new tokens: four different answers, so a comparison with them
    can fail."""
    out = [tokens(generate(llm, [p], 80))[0] for p in embedded["prompts"]]
    assert len({tuple(t) for t in out}) == len(out) and all(len(set(t)) > 1 for t in out)
    return out


def test_requests_joining_and_aborted_mid_run_leave_the_others_their_solo_tokens(llm, embedded, solo):
    p = embedded["prompts"]
    arrivals = {0: [("a", p[0], params(80)), ("c", p[2], params(80))], 7: [("b", p[1], params(80))]}
    arrivals[30] = [("d", p[3], params(80))]
    done = drive(llm, arrivals, aborts={20: ["c"]})
    assert sorted(done) == ["a", "b", "d"]  # an aborted request has no final output here
    assert [list(done[r].outputs[0].token_ids) for r in "abd"] == [solo[0], solo[1], solo[3]]
    assert all(done[r].kv_transfer_params["epikv"]["evictions"] > 0 for r in "abd")
    assert_nothing_left(llm)


def test_a_row_that_would_pass_its_cap_in_a_live_engine_fails_alone(llm, embedded, solo):
    """The worker's last guard (issue 42 item 6): a row whose next tokens would pass its cap has them
    written nowhere and fails alone; here its cap is lowered by hand after a few steps."""
    p, records = embedded["prompts"], worker_state(llm).requests.records

    def shrink(step):
        if step == 5:
            internal = next(r for r in records if r.startswith("b-"))
            records[internal].cap = 10  # it holds more than that already

    done = drive(llm, {0: [("a", p[0], params(80)), ("b", p[1], params(80))]}, on_step=shrink)
    assert done["b"].outputs[0].finish_reason == "error"
    assert "past its cap of 10" in done["b"].kv_transfer_params["epikv"]["error"]
    assert list(done["a"].outputs[0].token_ids) == solo[0]
    assert_nothing_left(llm)


def test_a_forced_preemption_fails_the_running_requests_alone_and_the_engine_serves_on(llm, embedded, solo):
    p = embedded["prompts"]

    def reset(step):
        if step == 12:  # the weight-sync path: every running request is preempted
            assert core(llm).scheduler.reset_prefix_cache(reset_running_requests=True)

    done = drive(llm, {0: [("a", p[0], params(80)), ("b", p[1], params(80))]}, on_step=reset)
    for r in "ab":
        assert done[r].outputs[0].finish_reason == "error"
        assert "preempted" in done[r].kv_transfer_params["epikv"]["error"]
    assert tokens(generate(llm, [p[2]], 80))[0] == solo[2]  # still serving, exactly
    assert_nothing_left(llm)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_a_pause_that_keeps_requests_freezes_them_or_fails_them_alone(llm, embedded, solo, clear_cache):
    """vLLM's ``pause_generation(mode="keep")``: without clearing the cache the running requests
    freeze (no step computes a token for them) and, resumed, give their solo tokens; clearing it
    (vLLM's default) resets the prefix cache with requests running, which preempts them: each
    evicting request fails alone with one line, and the engine serves on, exactly."""
    p, computed = embedded["prompts"], {}

    def pause(step):
        if step == 12:
            core(llm).pause_scheduler(mode="keep", clear_cache=clear_cache)
        if step in (13, 19):
            computed[step] = sorted(r.num_computed_tokens for r in core(llm).scheduler.requests.values())
        if step == 20:
            core(llm).resume_scheduler()

    done = drive(llm, {0: [("a", p[0], params(80)), ("b", p[1], params(80))]}, on_step=pause)
    if clear_cache:
        assert computed[13] == computed[19] == []  # failed at the pause, gone from the scheduler
        for r in "ab":
            assert done[r].outputs[0].finish_reason == "error"
            assert "preempted" in done[r].kv_transfer_params["epikv"]["error"]
    else:
        assert computed[13] == computed[19] and len(computed[13]) == 2 and min(computed[13]) > len(p[0])
        assert [list(done[r].outputs[0].token_ids) for r in "ab"] == solo[:2]
    assert tokens(generate(llm, [p[2]], 80))[0] == solo[2]
    assert_nothing_left(llm)


def test_a_fault_in_one_requests_step_fails_that_request_alone(llm, embedded, solo, monkeypatch):
    from vllm.exceptions import GenerationError

    from epikv.vllm.answers import failure

    state = worker_state(llm)
    p = embedded["prompts"]
    bad = len(p[1])
    assert bad not in (len(p[0]), len(p[2]))
    prefill = type(state)._prefill

    def broken(self, req_id, *args):
        if self.requests.records[req_id].books.prompt_len[0] == bad:
            raise RuntimeError("a fault for the test")
        return prefill(self, req_id, *args)

    monkeypatch.setattr(type(state), "_prefill", broken)
    out = generate(llm, p[:3], 80)
    monkeypatch.undo()
    assert out[1].outputs[0].finish_reason == "error"
    assert "prefill failed: RuntimeError: a fault for the test" in out[1].kv_transfer_params["epikv"]["error"]
    # its response (vllm serve): vLLM's 500 with the line its own output carries; a fault, not a refusal
    error = failure(out[1], "messages")
    assert type(error) is GenerationError and str(error) == out[1].kv_transfer_params["epikv"]["error"]
    assert failure(out[0], "messages") is None
    assert [tokens([o])[0] for o in (out[0], out[2])] == [solo[0], solo[2]]
    assert tokens(generate(llm, [p[1]], 80))[0] == solo[1]
    assert_nothing_left(llm)


def test_a_fault_in_epikvs_front_end_bookkeeping_never_reaches_vllms_output_handler(
    llm, embedded, solo, monkeypatch, caplog
):
    from epikv.vllm.metrics import Latest

    def broken(self, outputs, running):
        raise RuntimeError("a bookkeeping fault for the test")

    monkeypatch.setattr(Latest, "see", broken)
    out = generate(llm, embedded["prompts"][:2], 80)  # vLLM's output handler would die of a raise
    monkeypatch.undo()
    assert tokens(out) == solo[:2] and all(o.kv_transfer_params is not None for o in out)
    assert "epikv: reading a step's counters failed and was skipped" in caplog.text
    assert tokens(generate(llm, embedded["prompts"][:1], 80)) == solo[:1]
    assert_nothing_left(llm)


def failing_decode_compaction(state, monkeypatch, when):
    """The policy's scoring raises in a decode step's compaction whenever ``when(view)``; returns each
    decode call's (rows' prompt lengths, budget, step: tokens decoded by its first row)."""
    policy = type(state.spec.policy)
    score, calls = policy.score, []

    def broken(self, st, view):
        step = int(view.seen[0] - view.prompt_len[0])
        if step > 0:
            calls.append((view.prompt_len.tolist(), view.budget, step))
            if when(view):
                raise RuntimeError("a fault for the test")
        return score(self, st, view)

    monkeypatch.setattr(policy, "score", broken)
    return calls


def test_a_fault_in_one_rows_decode_compaction_fails_that_request_alone(llm, embedded, solo, monkeypatch):
    p = embedded["prompts"]
    bad = len(p[1])
    calls = failing_decode_compaction(worker_state(llm), monkeypatch, lambda v: bad in v.prompt_len.tolist())
    out = generate(llm, p[:3], 80)
    monkeypatch.undo()
    assert any(bad in rows and len(rows) == 3 for rows, _, _ in calls)  # scored with the others, raised
    assert out[1].outputs[0].finish_reason == "error"
    error = out[1].kv_transfer_params["epikv"]["error"]
    assert "compaction failed: RuntimeError: a fault for the test" in error
    assert [tokens([o])[0] for o in (out[0], out[2])] == [solo[0], solo[2]]  # retried alone, exactly
    assert_nothing_left(llm)


def test_a_failing_second_budget_group_leaves_the_first_groups_requests_their_tokens(
    llm, embedded, monkeypatch
):
    p, small = embedded["prompts"], {BUDGET_ARG: 40}
    alone = [generate_with_tokens(llm, p[i], small) for i in (0, 2)]
    calls = failing_decode_compaction(worker_state(llm), monkeypatch, lambda v: v.budget == K)
    prompts = [TokensPrompt(prompt_token_ids=p[i]) for i in range(3)]
    sampling = [params(80, extra_args=small), params(80), params(80, extra_args=small)]
    out = llm.generate(prompts, sampling, use_tqdm=False)
    monkeypatch.undo()
    # in one step the first group (40: rows 0 and 2) was compacted, then the second (K: row 1) raised
    first = {step for rows, k, step in calls if k == 40 and rows == [len(p[0]), len(p[2])]}
    assert first & {step for rows, k, step in calls if k == K}
    assert out[1].outputs[0].finish_reason == "error"
    assert "compaction failed" in out[1].kv_transfer_params["epikv"]["error"]
    assert [tokens([o])[0] for o in (out[0], out[2])] == alone
    assert_nothing_left(llm)


def generate_with_tokens(llm, prompt, extra):
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(80, extra_args=extra), use_tqdm=False)
    return tokens(out)[0]


def test_a_request_the_front_end_did_not_check_is_refused_by_the_scheduler_alone(llm, embedded, solo):
    from vllm.v1.engine import EngineCoreRequest

    from epikv.vllm.answers import failure

    processor, tasks = llm.llm_engine.input_processor, llm.llm_engine.get_supported_tasks()
    good = processor.process_inputs(
        "x", TokensPrompt(prompt_token_ids=embedded["prompts"][0]), params(80), tasks
    )
    assert isinstance(good, EngineCoreRequest)
    processor._epikv_spec = None  # as if it came another way: the front end's check is skipped
    try:
        prompt = TokensPrompt(prompt_token_ids=embedded["prompts"][3])
        bad = processor.process_inputs("y", prompt, params(80, extra_args={BUDGET_ARG: 999}), tasks)
    finally:
        del processor._epikv_spec
    done = drive(llm, {0: [("x", good, good.params), ("y", bad, bad.params)]})
    assert done["y"].outputs[0].finish_reason == "error" and list(done["y"].outputs[0].token_ids) == []
    assert "epikv_budget=999" in done["y"].kv_transfer_params["epikv"]["error"]
    # a refusal: it can never run, so its answer is a 400 naming the field, never a retryable 500
    assert done["y"].kv_transfer_params["epikv"]["refused"] == "budget"
    assert failure(done["y"], "messages").parameter == BUDGET_ARG
    assert list(done["x"].outputs[0].token_ids) == solo[0]
    assert_nothing_left(llm)


def test_a_per_request_budget_bounds_that_request_and_a_bad_one_is_refused(llm, embedded):
    from vllm.exceptions import VLLMValidationError

    p = embedded["prompts"][0]
    small, default = generate_with(llm, p, {BUDGET_ARG: 40}), generate_with(llm, p, None)
    # its own cap: max(P, K + tau), tau = 1 (a prompt longer than K is held whole once)
    assert small["budget"] == 40 and small["peak_cache_tokens"] == max(len(p), 41)
    assert default["budget"] == K and default["peak_cache_tokens"] == max(len(p), K + 1)
    assert small["evictions"] == default["evictions"] + (K - 40)
    for value in (0, K + 1, "many"):
        with pytest.raises(VLLMValidationError, match=f"epikv_budget={value!r}"):
            generate_with(llm, p, {BUDGET_ARG: value})
    assert_nothing_left(llm)


def generate_with(llm, prompt, extra):
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(60, extra_args=extra), use_tqdm=False)
    return out[0].kv_transfer_params["epikv"]


def test_a_prompt_longer_than_k_plus_tau_runs_bounded_by_its_own_cap(llm):
    prompt = [(7 * i) % 900 + 100 for i in range(150)]  # 150 tokens > K + tau = 49
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params(20), use_tqdm=False)[0]
    stats = out.kv_transfer_params["epikv"]
    assert len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"
    # held whole by the prefill (150), compacted to K right after, then K + 1 at most
    assert stats["peak_cache_tokens"] == 150 and stats["evictions"] == 150 + 19 - K
    assert_nothing_left(llm)


def test_a_stop_string_finish_carries_the_counters_of_its_last_step(llm, embedded):
    p = embedded["prompts"][1]
    free = llm.generate([TokensPrompt(prompt_token_ids=p)], params(60), use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2 :][:12]  # a string the greedy answer reaches mid-way
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], params(60, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) < 60
    n = len(out.outputs[0].token_ids)
    stats = out.kv_transfer_params["epikv"]
    # the last token fed back is the (n-1)-th generated one: P + n - 1 tokens seen, K held at most + 1
    assert stats["evictions"] == len(p) + n - 1 - K and stats["peak_cache_tokens"] == K + 1
    assert_nothing_left(llm)


def test_each_child_of_n_greater_than_one_reports_its_counters(llm, embedded):
    p = embedded["prompts"][2]
    sampling = SamplingParams(n=3, seed=1, temperature=1.0, max_tokens=40, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], sampling, use_tqdm=False)[0]
    choices = out.kv_transfer_params["epikv_choices"]
    assert len(out.outputs) == len(choices) == 3
    # each child evicts one token per step over K: P + 39 tokens fed; peak max(P, K + 1)
    for c in choices:
        assert c["budget"] == K and c["evictions"] == len(p) + 39 - K
        assert c["peak_cache_tokens"] == max(len(p), K + 1)
    assert_nothing_left(llm)


def test_the_pinned_attributes_are_on_a_live_engine(llm, embedded):
    from epikv.vllm import pins

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    scheduler = core(llm).scheduler
    llm.llm_engine.add_request("live", TokensPrompt(prompt_token_ids=embedded["prompts"][0]), params(2))
    request = next(r for rid, r in scheduler.requests.items() if rid.startswith("live"))  # internal id
    for obj, names in [
        (runner, pins.RUNNER_ATTRS),
        (runner.input_batch, pins.INPUT_BATCH_ATTRS),
        (runner.input_batch.block_table[0], pins.BLOCK_TABLE_ATTRS),
        (request, pins.REQUEST_ATTRS),
        (scheduler, pins.SCHEDULER_ATTRS),
        (llm.llm_engine, pins.INIT_ATTRS["vllm.v1.engine.llm_engine:LLMEngine"]),
    ]:
        missing = [n for n in names if not hasattr(obj, n)]
        assert not missing, f"{type(obj).__name__} lacks {missing}"
    assert llm.llm_engine.input_processor.epikv_pool == BLOCKS - 1  # in process: one pool, its null block
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert_nothing_left(llm)


def test_chunked_prompts_beside_decode_rows_give_each_request_its_solo_tokens(tiny, embedded, solo):
    llm = make_llm(tiny["served"], max_num_batched_tokens=16, **epikv.vllm.engine_kwargs("streaming", K))
    state, seen = worker_state(llm), []
    after_forward = state.after_forward

    def spy(batch, aux):
        prefill = batch.computed < batch.prompts
        seen.append((bool(prefill.any() and (~prefill).any()), bool((prefill & (batch.computed > 0)).any())))
        return after_forward(batch, aux)

    state.after_forward = spy
    p = embedded["prompts"]
    arrivals = {0: [("a", p[0], params(80))], 5: [("b", p[1], params(80)), ("c", p[2], params(80))]}
    arrivals[9] = [("d", p[3], params(80))]
    done = drive(llm, arrivals)
    assert [list(done[r].outputs[0].token_ids) for r in "abcd"] == solo
    assert any(m for m, _ in seen) and any(c for _, c in seen)  # mixed steps, and later prompt chunks
    assert_nothing_left(llm)
    close(llm)


def test_admission_charges_each_request_what_it_can_hold_not_k_plus_tau(tiny, embedded):
    blocks, budget = 64, 256  # 63 usable: one request of max_model_len = 2,016 tokens, as vLLM checks
    kwargs = epikv.vllm.engine_kwargs("streaming", budget)
    pool = {"num_gpu_blocks_override": blocks, "max_model_len": (blocks - 1) * 32}
    llm = make_llm(tiny["served"], **pool, **kwargs)
    scheduler = core(llm).scheduler
    running, held, schedule = [], [], scheduler.schedule

    def watch(*args, **kwargs):
        out = schedule(*args, **kwargs)
        assert not out.preempted_req_ids
        running.append(len(scheduler.running))
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        held.append({r: len(b) for r, b in manager.req_to_blocks.items()})
        return out

    scheduler.schedule = watch
    prompts = [embedded["prompts"][i % 4] for i in range(16)]
    out = generate(llm, prompts, 24)
    close(llm)
    reserve = {cdiv(len(p) + 24, 32) for p in prompts}
    assert all(n in reserve for step in held for n in step.values())  # min(cap, P + max_tokens)
    assert all(sum(step.values()) <= blocks - 1 for step in held)
    assert max(running) == 16  # charged K + tau = 257 tokens (9 blocks) each, only 63 // 9 = 7 would run
    assert all(o.outputs[0].finish_reason == "length" for o in out)
