"""The plugin in a running vLLM engine (in-process, float32, eager), against plain vLLM and against
epikv's own engine: same tokens where nothing is evicted, the same kept sets where the policy's choice
depends on positions only, bounded blocks, solo tokens under row churn, and refusals at start-up."""

from __future__ import annotations

import pytest
import torch

import epikv.vllm
from epikv.vllm.config import Refused
from tests.vllm.engines import (
    agree,
    close,
    generate,
    kept_sets,
    make_llm,
    reference_run,
    tokens,
    worker_state,
)

N = 64  # new tokens per request
LONG = 128  # under Seg-Q at K = 96, tau = 16: past K + tau, so every request evicts


@pytest.fixture(scope="module")
def plain(embedded):
    llm = make_llm(embedded["folder"])
    out = generate(llm, embedded["prompts"], N, logprobs=1)
    close(llm)
    return out


@pytest.fixture(scope="module")
def full(embedded):
    """epikv's own engine with the full cache on the same prompts (the baseline of token agreement)."""
    return reference_run("full", None, embedded["prompts"], N)


def logprobs(outputs):
    return [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs]


def test_full_under_the_plugin_gives_plain_vllm_tokens_and_logprobs(embedded, plain):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    llm = make_llm(embedded["folder"], **epikv.vllm.engine_kwargs("full"))
    out = generate(llm, embedded["prompts"], N, logprobs=1)
    asked = SamplingParams(max_tokens=4, extra_args={"epikv_budget": 64})  # epikv's engine refuses it too
    with pytest.raises(VLLMValidationError, match="keeps every token: a request budget cannot be set"):
        llm.generate([TokensPrompt(prompt_token_ids=embedded["prompts"][0])], asked, use_tqdm=False)
    close(llm)
    assert tokens(out) == tokens(plain)
    assert logprobs(out) == logprobs(plain)  # bit for bit: the plugin changes nothing without eviction


def test_a_budget_that_never_evicts_gives_plain_vllm_tokens(embedded, plain):
    llm = make_llm(embedded["folder"], **epikv.vllm.engine_kwargs("epikv-flat", 4000))
    out = generate(llm, embedded["prompts"], N)
    close(llm)
    assert tokens(out) == tokens(plain)


@pytest.fixture(scope="module")
def streaming(embedded, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "kept.jsonl"
    llm = make_llm(embedded["folder"], **epikv.vllm.engine_kwargs("streaming", 64, trace=str(trace)))
    yield llm, trace
    close(llm)


def test_streaming_keeps_exactly_epikvs_sets_at_every_compaction(embedded, plain, full, streaming):
    llm, trace = streaming
    trace.write_text("")
    out = generate(llm, embedded["prompts"], N)
    ref = reference_run("streaming", 64, embedded["prompts"], N)
    ours = kept_sets(trace, out)
    for i, prompt in enumerate(embedded["prompts"]):
        # one per step once over K (the last chosen token is never fed back)
        assert len(ours[i]) == len(ref["kept"][i]) == len(prompt) + N - 1 - 64
        assert ours[i] == ref["kept"][i], f"request {i}: kept sets differ from epikv's engine"
        # tokens agree at least as long as plain vLLM and epikv's full cache agree
        baseline = agree(tokens(plain)[i], full["tokens"][i])
        assert baseline >= N // 2  # fp32: the two engines' full caches agree that long at least
        assert agree(tokens(out)[i], ref["tokens"][i]) >= baseline
    for o, prompt in zip(out, embedded["prompts"], strict=True):  # what the request's output reports
        evicted = len(prompt) + N - 1 - 64
        assert o.kv_transfer_params["epikv"] == {
            "peak_cache_tokens": 65,
            "evictions": evicted,
            "compactions": evicted,
            "budget": 64,
        }


def test_requests_that_finish_at_different_times_give_their_solo_tokens(embedded, streaming):
    llm, _ = streaming
    lengths = [40, N, 90, 20]
    together = tokens(generate(llm, embedded["prompts"], lengths))
    for prompt, n, got in zip(embedded["prompts"], lengths, together, strict=True):
        assert tokens(generate(llm, [prompt], n))[0] == got


def test_seg_q_stays_bounded_and_recomputes_vllms_own_queries(tiny, embedded, monkeypatch):
    """On the tiny Llama with the embedded model's vocabulary (what is compared is this engine's own
    queries and tokens, so the 30-layer model is not needed)."""
    seg_q = epikv.vllm.engine_kwargs("epikv", 96, interval=16)
    llm = make_llm(tiny["served"], max_model_len=512, **seg_q)
    state = worker_state(llm)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    layer = state.spec.policy.query_layer
    seen = {}
    decoder = runner.model.model.layers[layer]
    hooks = [
        decoder.register_forward_pre_hook(
            lambda m, args: seen.update(
                h=(args[1] + args[2]) if args[2] is not None else args[1], pos=args[0]
            )
        ),
        decoder.self_attn.attn.register_forward_pre_hook(lambda m, args: seen.update(q=args[0])),
    ]
    out = generate(llm, embedded["prompts"], LONG)
    for hook in hooks:
        hook.remove()
    mine = state.store.project_queries(layer, seen["h"][None].float(), seen["pos"][None])[0]  # (Hq, T, D)
    theirs = seen["q"].reshape(seen["q"].shape[0], mine.shape[0], -1).transpose(0, 1)
    torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-5, rtol=1e-5)
    counters = [o.kv_transfer_params["epikv"] for o in out]
    assert all(c["peak_cache_tokens"] <= 96 + 16 and c["evictions"] > 0 for c in counters)
    assert len({tuple(t) for t in tokens(out)}) == len(out)  # the fault's comparison below can fail
    stops_at_max_model_len_and_serves_on(llm)
    a_fault_fails_its_request_alone(llm, embedded["prompts"], tokens(out), monkeypatch)
    close(llm)


def stops_at_max_model_len_and_serves_on(llm):
    """Issue 57 item 1, offline: a 400-token prompt runs at K = 528 (its prompt and a recent window of
    128), so its cap is 544 tokens, 17 blocks, past the runner's row of 512 // 32 = 16: the
    reservation is clamped as vLLM clamps its own. vLLM stops the request at max_model_len (112 new
    tokens, ``length``) and the engine serves on. Before: EngineDeadError for every later call."""
    prompt = [(7 * i) % 900 + 100 for i in range(400)]
    done = generate(llm, [prompt], 512)[0]
    assert done.outputs[0].finish_reason == "length" and len(done.outputs[0].token_ids) == 512 - 400
    assert done.kv_transfer_params["epikv"]["budget"] == 528
    assert [o.outputs[0].finish_reason for o in generate(llm, [prompt[:50]], 8)] == ["length"]


def a_fault_fails_its_request_alone(llm, prompts, solo, monkeypatch):
    """Under Seg-Q, the default: scoring raises whenever request 1 is among the rows scored; it fails
    alone with its line (the batched call is retried row by row), the others give their tokens."""
    policy = type(worker_state(llm).spec.policy)
    score, bad = policy.score, len(prompts[1])
    assert bad not in [len(p) for i, p in enumerate(prompts) if i != 1]

    def broken(self, state, view):
        if bad in view.prompt_len.tolist():
            raise RuntimeError("a fault for the test")
        return score(self, state, view)

    monkeypatch.setattr(policy, "score", broken)
    out = generate(llm, prompts, LONG)
    monkeypatch.undo()
    assert [o.outputs[0].finish_reason for o in out] == ["length", "error", "length", "length"]
    line = out[1].kv_transfer_params["epikv"]["error"]
    assert line.endswith("compaction failed: RuntimeError: a fault for the test")
    assert [tokens(out)[i] for i in (0, 2, 3)] == [solo[i] for i in (0, 2, 3)]
    assert tokens(generate(llm, [prompts[1]], LONG)) == [solo[1]]


def test_a_pool_for_one_full_request_runs_many_bounded_ones_without_preemption(tiny):
    """Admission alone, on the tiny Llama (the model does not matter, and it is fast)."""
    blocks = 16  # 512 tokens: one 420-token request's full cache fits, two do not
    pool = {"num_gpu_blocks_override": blocks, "max_model_len": 480}  # 15 usable: what one request holds
    llm = make_llm(tiny["llama"], **pool, **epikv.vllm.engine_kwargs("streaming", 96))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    running, held, schedule = [], [], scheduler.schedule

    def watch(*args, **kwargs):
        out = schedule(*args, **kwargs)
        running.append(len(scheduler.running))
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        held.append(max((len(b) for b in manager.req_to_blocks.values()), default=0))
        return out

    scheduler.schedule = watch
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 40000, (20,), generator=gen).tolist() for _ in range(8)]
    out = generate(llm, prompts, 400)
    close(llm)
    assert all(o.outputs[0].finish_reason == "length" for o in out)  # none preempted or failed
    assert max(held) == 4  # ceil((96 + 1) / 32) blocks per request, never more
    assert max(running) == (blocks - 1) // 4 == 3  # admission by each reservation; vLLM fits one at a time


def test_unsupported_settings_are_refused_at_start_up(embedded):
    with pytest.raises(Refused, match="prefix caching"):
        make_llm(
            embedded["folder"], **{**epikv.vllm.engine_kwargs("streaming", 64), "enable_prefix_caching": True}
        )
    with pytest.raises(Refused, match="attention weights"):
        make_llm(embedded["folder"], **epikv.vllm.engine_kwargs("h2o", 64))


@pytest.mark.parametrize("policy", ["keydiff", "lagkv"])
def test_key_and_value_scored_policies_keep_epikvs_sets_while_tokens_agree(
    embedded, plain, full, policy, tmp_path
):
    trace = tmp_path / "kept.jsonl"
    llm = make_llm(embedded["folder"], **epikv.vllm.engine_kwargs(policy, 64, trace=str(trace)))
    out = generate(llm, embedded["prompts"], N)
    close(llm)
    ref = reference_run(policy, 64, embedded["prompts"], N)
    ours = kept_sets(trace, out)
    for i in range(len(embedded["prompts"])):
        baseline = agree(tokens(plain)[i], full["tokens"][i])
        assert baseline >= N // 2  # fp32: the two engines' full caches agree that long at least
        same = agree(tokens(out)[i], ref["tokens"][i])
        assert same >= baseline
        assert ours[i], "no compaction ran"
        # every compaction whose inputs both engines share (tokens fed so far agree) keeps the same set
        shared = [
            k
            for k, r in zip(ours[i], ref["kept"][i], strict=False)
            if max(k) < len(embedded["prompts"][i]) + same
        ]
        assert shared == ref["kept"][i][: len(shared)], f"request {i}: {policy} kept sets differ"


def test_prompts_past_k_run_at_their_raised_k_keeping_epikvs_sets(embedded, tmp_path):
    """Issue 42 item 0: under a policy that protects the prompt, K 32 holds none of these prompts and
    their recent window; each runs at the smallest K that does (the plan's rule), keeping exactly its
    prompt and its newest tokens at every compaction, as epikv's engine keeps them."""
    trace = tmp_path / "kept.jsonl"
    llm = make_llm(embedded["folder"], **epikv.vllm.engine_kwargs("epikv-flat", 32, trace=str(trace)))
    spec = worker_state(llm).spec
    prompts, n = embedded["prompts"], 48
    out = generate(llm, prompts, n)
    close(llm)
    ref = reference_run("epikv-flat", 32, prompts, n)
    ours = kept_sets(trace, out)
    for i, (prompt, o) in enumerate(zip(prompts, out, strict=True)):
        k = spec.min_budget(len(prompt))
        recent = min(128, k // 4)
        assert k > 32 and len(prompt) + recent == k  # every kept token is protected
        assert o.kv_transfer_params["epikv"]["budget"] == k
        assert o.kv_transfer_params["epikv"]["peak_cache_tokens"] == k + 1
        assert ours[i] == ref["kept"][i] and len(ours[i]) == len(prompt) + n - 1 - k, i
        for step, kept in enumerate(ours[i]):
            seen = k + 1 + step
            assert sorted(kept) == [*range(len(prompt)), *range(seen - recent, seen)], (i, step)
