"""The plugin on every model type of epikv's architecture table beside Llama (which the embedded
model covers), all of which vLLM's CPU backend runs: Qwen2 (q/k/v with biases), Mistral, Qwen3 and
Qwen3-MoE (a query norm per head), Phi-3 (fused qkv, partial RoPE), GLM-4.5, OLMo-2 and Seed-OSS, and
the hybrids with sliding-window layers: Gemma 3, EXAONE 4, gpt-oss (learned sinks, half-width RoPE
tables), OLMo-3 and SmolLM3. OLMo-2, Seed-OSS, OLMo-3 and SmolLM3 run on vLLM's Transformers backend;
GLM-4.5, Gemma 3 and EXAONE 4 run natively without the aux-hidden-state path Seg-Q reads, and on that
backend with ``--model-impl transformers``. Each is epikv's tiny model of that type
(:mod:`epikv.models.tiny`) with heads of 32 and weights drawn at std 0.2 (Gemma 3: 0.02), so logits
are far from flat and token comparisons mean something. Per type: ``full`` under the plugin gives
epikv's own engine's tokens (float32, the reference the other cases match too; the plugin's ``full``
against plain vLLM, logprobs included, is ``test_engine.py``'s, on Llama); ``streaming`` keeps
exactly epikv's engine's position sets at every compaction
and yields its tokens (a hybrid's sliding layers stay vLLM's own: its tokens would differ if a
compaction touched them); Seg-Q stays within its cap and its recomputed queries equal the ones vLLM's
attention receives (natively refused first where the path is missing, with the line). Seg-Q's kept
sets equal epikv's engine's on four types whose query path is least like Llama's.
``test_hybrids.py`` checks the hybrids' blocks and admission."""

from __future__ import annotations

import inspect

import pytest
import torch

import epikv.vllm
from epikv.vllm.config import Refused
from epikv.vllm.queries import ATTENTION
from tests.vllm.engines import close, generate, kept_sets, make_llm, reference_run, tokens, worker_state

N = 40  # new tokens per request
K = 24  # streaming's budget: every request evicts
QUERIES = (
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gpt_oss",
    "olmo2",
    "seed_oss",
    "olmo3",
    "smollm3",
)
NO_QUERIES = ("glm4_moe", "gemma3_text", "exaone4")  # Seg-Q refused: no aux-hidden-state path in vLLM


@pytest.fixture(scope="module", params=QUERIES + NO_QUERIES)
def arch(request, tiny):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (9, 17, 30)]
    return request.param, tiny[request.param], prompts


def _llm(folder: str, **kwargs):
    return make_llm(folder, max_model_len=512, **kwargs)


@pytest.mark.slow
def test_full_under_the_plugin_gives_epikvs_engine_tokens(arch):
    """Behind ``-m slow`` (one engine start per type, about 12 s each): streaming's case below gives
    epikv's engine's tokens under eviction on every type, which needs the same model; what ``full``
    adds is the path that never evicts, the same on every type (``test_engine.py``, on Llama)."""
    _, folder, prompts = arch
    llm = _llm(folder, **epikv.vllm.engine_kwargs("full"))
    got = tokens(generate(llm, prompts, N))
    close(llm)
    expected = reference_run("full", None, prompts, N, model=folder)["tokens"]
    assert got == expected
    assert len({tuple(t) for t in expected}) == len(prompts)  # not one flat answer for every prompt


def test_streaming_keeps_exactly_epikvs_sets_at_every_compaction(arch, tmp_path):
    _, folder, prompts = arch
    trace = tmp_path / "kept.jsonl"
    llm = _llm(folder, **epikv.vllm.engine_kwargs("streaming", K, trace=str(trace)))
    out = generate(llm, prompts, N)
    close(llm)
    ref = reference_run("streaming", K, prompts, N, model=folder)
    ours = kept_sets(trace, out)
    for i, prompt in enumerate(prompts):
        # one per step once over K; a prompt longer than K is held whole, then cut once at its end
        assert len(ours[i]) == len(ref["kept"][i]) == min(N, len(prompt) + N - 1 - K)
        assert ours[i] == ref["kept"][i], f"request {i}: kept sets differ from epikv's engine"
    assert tokens(out) == ref["tokens"]  # what the kept tokens (and a hybrid's windows) make
    assert len({tuple(t) for t in ref["tokens"]}) == len(prompts)  # not one flat answer for every prompt
    peaks = [o.kv_transfer_params["epikv"]["peak_cache_tokens"] for o in out]
    assert peaks == [max(len(p), K + 1) for p in prompts]


def test_seg_q_stays_bounded_and_recomputes_vllms_own_queries(arch):
    kind, folder, prompts = arch
    options = epikv.vllm.engine_kwargs("epikv", 48, interval=8)
    if kind in NO_QUERIES:  # Seg-Q reads the residual stream through that path: refused at start-up,
        with pytest.raises(Refused, match=r"aux-hidden-state path.*--model-impl transformers"):
            _llm(folder, **options)
        options["model_impl"] = "transformers"  # and runs where the refusal points: transformers' modules
    llm = _llm(folder, **options)
    state = worker_state(llm)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    layer = state.spec.policy.query_layer
    decoder = runner.model.model.layers[layer]
    signature = inspect.signature(decoder.forward)
    seen = {}

    def entering(module, args, kwargs):  # the residual stream entering the layer, and the positions
        bound = signature.bind_partial(*args, **kwargs).arguments
        hidden, residual = bound["hidden_states"], bound.get("residual")
        hidden = hidden.reshape(-1, hidden.shape[-1])  # transformers' modules keep a batch of one
        positions = bound["positions"] if "positions" in bound else bound["position_ids"]
        seen.update(h=hidden if residual is None else hidden + residual, pos=positions.reshape(-1))

    attention = getattr(decoder, ATTENTION.get(kind, "self_attn")).attn  # vLLM's attention layer
    forward = attention.forward

    def receiving(query, *args, **kwargs):  # the Transformers backend calls ``forward`` itself
        seen["q"] = query
        return forward(query, *args, **kwargs)

    attention.forward = receiving
    hooks = [decoder.register_forward_pre_hook(entering, with_kwargs=True)]
    out = generate(llm, prompts, N)
    for hook in hooks:
        hook.remove()
    mine = state.store.project_queries(layer, seen["h"][None].float(), seen["pos"][None])[0]  # (Hq, T, D)
    theirs = seen["q"].reshape(seen["q"].shape[0], mine.shape[0], -1).transpose(0, 1)
    close(llm)
    torch.testing.assert_close(mine.float(), theirs.float(), atol=1e-5, rtol=1e-5)
    counters = [o.kv_transfer_params["epikv"] for o in out]
    assert all(c["peak_cache_tokens"] <= 48 + 8 for c in counters)
    assert sum(c["evictions"] for c in counters) > 0


SETS = ("gpt_oss", "olmo3", "smollm3", "exaone4")


@pytest.mark.parametrize("kind", SETS)
def test_seg_q_keeps_exactly_epikvs_sets_and_tokens(kind, tiny, tmp_path):
    """Seg-Q end to end where its query path is least like Llama's: a native hybrid with learned sinks
    (gpt-oss), and on vLLM's Transformers backend a hybrid with a RoPE table per layer kind (OLMo-3),
    layers without RoPE (SmolLM3) and a hybrid whose global layers have none (EXAONE 4, on that
    backend by ``--model-impl transformers``): the band layers' hidden states, the recomputed queries
    and the scores all meet in the kept sets, which equal epikv's engine's at every compaction."""
    folder = tiny[kind]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (9, 17, 30)]
    trace = tmp_path / "kept.jsonl"
    impl = {"model_impl": "transformers"} if kind in NO_QUERIES else {}
    llm = _llm(folder, **impl, **epikv.vllm.engine_kwargs("epikv", 40, interval=32, trace=str(trace)))
    out = generate(llm, prompts, 96)  # tau = 32: two compactions or more per request
    close(llm)
    ref = reference_run("epikv", 40, prompts, 96, model=folder, interval=32)
    ours = kept_sets(trace, out)
    assert min(len(sets) for sets in ours) >= 2
    assert ours == ref["kept"]
    assert tokens(out) == ref["tokens"]
