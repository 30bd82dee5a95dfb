"""Tensor parallelism: tp = 2 on this CPU (``VLLM_CPU_OMP_THREADS_BIND`` binds each rank to one of the
first two cores this process may run on), on epikv's tiny Llama (4 query heads over 2 KV heads, so
each rank holds one KV head).

Each rank's pages hold its own heads; at a compaction the policy scores whole heads (keys, values and
recomputed queries gathered across ranks), every rank takes the first rank's scores, and each moves
its own heads' tokens with the same kept indices (``epikv.vllm.compaction.HeadShards``). The
reference is epikv's own engine (float32, the one the plugin at tp = 1 equals in ``test_engine.py``
and ``test_archs.py``), so no tp = 1 engine starts here. Proven: ``full`` under the plugin at tp = 2
gives epikv's engine's tokens; for ``streaming`` (positions only), ``epikv`` (Seg-Q: key variance
over every head, queries recomputed per rank and gathered) and ``keydiff`` (per head: each rank moves
its own head), the kept position sets at every compaction, the tokens and the counters at tp = 2
equal epikv's engine's; and on two hybrids (Gemma 3 with ``keydiff``, gpt-oss with Seg-Q) the kept
sets and tokens at tp = 2 equal epikv's engine's."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import epikv.vllm
from tests.vllm.engines import close, generate, kept_sets, make_llm, reference_run, tokens

N = 48


@pytest.fixture(scope="module")
def llama(tiny):
    gen = torch.Generator().manual_seed(2)
    return tiny["llama"], [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (9, 17, 24)]


CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="tensor parallelism 2 binds one CPU to each rank")


@contextlib.contextmanager
def engine(folder: str, policy: str, budget: int | None = None, **settings: Any) -> Iterator[Any]:
    """An engine at tp = 2 under the plugin (``policy`` at ``budget``), one rank on each CPU."""
    kwargs = epikv.vllm.engine_kwargs(policy, budget, **settings)
    kwargs.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CPUS[0]}|{CPUS[1]}")
        llm = make_llm(folder, max_model_len=512, **kwargs)
        try:
            yield llm
        finally:
            close(llm)


def run(llama: Any, policy: str, budget: int | None = None, **settings: Any):
    """The prompts at tp = 2 under the plugin (``policy`` at ``budget``): vLLM's request outputs."""
    folder, prompts = llama
    with engine(folder, policy, budget, **settings) as llm:
        return generate(llm, prompts, N)


def same_as_epikvs_engine(llama, out, trace, policy, budget, interval) -> None:
    """Kept sets at every compaction, tokens and counters at tp = 2 equal epikv's engine's."""
    folder, prompts = llama
    ref = reference_run(policy, budget, prompts, N, model=folder, interval=interval)
    assert sum(len(sets) for sets in ref["kept"]) >= len(prompts)  # every request compacted
    assert kept_sets(trace, out) == ref["kept"]
    assert tokens(out) == ref["tokens"]
    counters = [o.kv_transfer_params["epikv"] for o in out]
    assert counters == ref["counters"]
    for c, prompt in zip(counters, prompts, strict=True):
        assert c["peak_cache_tokens"] <= max(len(prompt), budget) + interval


def test_full_under_the_plugin_at_tp2_gives_epikvs_engine_tokens(llama):
    folder, prompts = llama
    expected = reference_run("full", None, prompts, N, model=folder)["tokens"]
    assert tokens(run(llama, "full")) == expected
    assert len({tuple(t) for t in expected}) == len(prompts)  # not one flat answer for every prompt


@pytest.mark.parametrize(("policy", "budget", "interval"), [("streaming", 24, 1), ("epikv", 40, 8)])
def test_every_rank_keeps_epikvs_positions_at_every_compaction(llama, tmp_path, policy, budget, interval):
    trace = tmp_path / "tp2.jsonl"
    out = run(llama, policy, budget, interval=interval, trace=str(trace))
    same_as_epikvs_engine(llama, out, trace, policy, budget, interval)


@pytest.mark.parametrize(("kind", "policy"), [("gemma3_text", "keydiff"), ("gpt_oss", "epikv")])
def test_a_hybrid_at_tp2_keeps_epikvs_positions_and_tokens(tiny, tmp_path, kind, policy):
    """A hybrid (sliding window of 6 in layers 0 and 2) splits its heads like any model: the global
    group's pages per rank, the sliding group vLLM's on each rank."""
    gen = torch.Generator().manual_seed(2)
    model = (tiny[kind], [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (9, 17, 24)])
    trace = tmp_path / "tp2.jsonl"
    out = run(model, policy, 40, interval=8, trace=str(trace))
    ref = reference_run(policy, 40, model[1], N, model=model[0], interval=8)
    assert sum(len(sets) for sets in ref["kept"]) >= 3  # every request compacted
    assert kept_sets(trace, out) == ref["kept"]
    assert tokens(out) == ref["tokens"]


def _fail_on_rank_1(worker: Any, prompt_len: int) -> int:
    """Runs in every worker (``collective_rpc``): on the rank holding heads 1.., the policy's
    scoring raises for a decode compaction that holds the request with ``prompt_len``."""
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    state = runner.epikv
    if state.store.shards.lo == 0:
        return 0
    policy = type(state.spec.policy)
    score = policy.score

    def broken(self, st, view):
        if prompt_len in view.prompt_len.tolist() and bool((view.seen > view.prompt_len).all()):
            raise RuntimeError("a fault on rank 1 for the test")
        return score(self, st, view)

    policy.score = broken
    policy.unbroken = score
    return 1


def _heal(worker: Any) -> None:
    policy = type((getattr(worker, "model_runner", None) or worker.worker.model_runner).epikv.spec.policy)
    if hasattr(policy, "unbroken"):
        policy.score = policy.unbroken


def test_keydiff_keeps_epikvs_positions_and_a_fault_on_rank_1_alone_fails_that_request(llama, tmp_path):
    """``keydiff`` (each rank scores and moves its own head) keeps epikv's engine's positions, tokens
    and counters at tp = 2, as above; then, in the same engine, a decode compaction that raises on
    rank 1 only (rank 0's output is what the scheduler reads): that request fails with rank 1's line,
    the others give their tokens without the fault, nothing waits in a collective, and the engine
    serves on, exactly."""
    folder, prompts = llama
    trace = tmp_path / "tp2.jsonl"
    with engine(folder, "keydiff", 40, interval=8, trace=str(trace)) as llm:
        first = generate(llm, prompts, N)
        same_as_epikvs_engine(llama, first, trace, "keydiff", 40, 8)
        ref = tokens(first)
        assert sorted(llm.collective_rpc(_fail_on_rank_1, args=(len(prompts[1]),))) == [0, 1]
        out = generate(llm, prompts, N)
        llm.collective_rpc(_heal)
        again = tokens(generate(llm, prompts, N))
    assert out[1].outputs[0].finish_reason == "error"
    error = out[1].kv_transfer_params["epikv"]["error"]
    assert "compaction failed: RuntimeError: a fault on rank 1 for the test" in error
    assert [tokens([o])[0] for o in (out[0], out[2])] == [ref[0], ref[2]]
    assert again == ref
