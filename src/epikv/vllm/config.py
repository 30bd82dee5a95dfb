"""The plugin's settings: what ``additional_config["epikv"]`` may hold, the run spec built from it for
the served model, and every configuration the plugin refuses, each with one line saying why.

Knows vLLM only through the config object handed in (read with ``getattr``), so the checks are
testable without an engine.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from epikv.archs import ARCHITECTURES, sliding_layers, window_problem
from epikv.errors import BudgetOutOfRange, PoolTooSmall
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec, parse_budget
from epikv.vllm.pins import VLLM_SERIES

KEY = "epikv"  # the key of ``additional_config`` the plugin reads
WORKER = "epikv.vllm.runner.EpiKVCPUWorker"
SCHEDULER = "epikv.vllm.scheduler.EpiKVScheduler"


class Refused(RuntimeError):
    """A configuration the plugin cannot run; the message is one line saying what and why."""


@dataclass(frozen=True)
class EpiKVSettings:
    """policy: an epikv policy name; budget: K tokens per request (None for ``full``); interval: tau
    (None = the policy's own); params: policy hyperparameters; trace: a JSONL file the worker
    appends each compaction's kept positions to (tests and studies; None = off)."""

    policy: str = "epikv"
    budget: int | None = None
    interval: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any] | None) -> EpiKVSettings | None:
        """The settings in ``additional_config`` (None when it has no ``epikv`` entry)."""
        if not raw or KEY not in raw:
            return None
        value = raw[KEY]
        if not isinstance(value, Mapping):
            raise Refused(f"additional_config['{KEY}'] must be a mapping, got {type(value).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise Refused(f"additional_config['{KEY}']: unknown key {unknown[0]!r}{hint}; known: {known}")
        params = value.get("params") or {}
        if not isinstance(params, Mapping):
            raise Refused(f"additional_config['{KEY}']['params'] must be a mapping, got {params!r}")
        return cls(
            policy=str(value.get("policy", cls.policy)),
            budget=value.get("budget"),
            interval=value.get("interval"),
            params=dict(params),
            trace=value.get("trace"),
        )

    def as_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        for name in ("budget", "interval", "trace"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.params:
            out["params"] = dict(self.params)
        return out

    def spec(self, model: ModelInfo) -> CacheSpec:
        """The run spec for the served model; refuses policies that read attention rows."""
        try:
            spec = CacheSpec.build(
                model, self.policy, self.budget, interval=self.interval, params=self.params
            )
        except ValueError as err:
            raise Refused(f"epikv: {err}") from err
        if spec.policy.needs().attention_layers:
            raise Refused(
                f"epikv: policy {spec.policy.name!r} reads attention weights, which vLLM's fused attention "
                "kernels never produce (EpiKV's point); use one that needs none: "
                + ", ".join(vllm_policies())
            )
        return spec


def vllm_policies() -> list[str]:
    """The policies the plugin runs: every one that needs no attention matrix."""
    from epikv.policies import policy_class, policy_names

    return [n for n in policy_names() if "attention_weights" not in policy_class(n).requires]


BUDGET_ARG = "epikv_budget"  # SamplingParams.extra_args key (``vllm_xargs`` in an OpenAI request body)


@dataclass(frozen=True)
class RequestPlan:
    """What one request may hold: budget, its K (None: never evicts); cap, the most physical tokens
    it ever holds (:meth:`CacheSpec.cap_tokens`); reserve, what admission charges it: the cap or, if
    smaller, its prompt plus ``max_tokens`` (None: nothing reserved, it grows as in plain vLLM)."""

    budget: int | None
    cap: int | None
    reserve: int | None


def plan_request(
    spec: CacheSpec, prompt_tokens: int, max_tokens: int | None, extra_args: Mapping[str, Any] | None
) -> RequestPlan:
    """The one rule for a request on both sides of vLLM (front end, scheduler, worker): its budget
    (``extra_args["epikv_budget"]``, 1..the server's K, or the server's K; raised for a prompt whose
    protected tokens pass it: :meth:`~epikv.spec.CacheSpec.prompt_budget`), its cap and its
    reservation. Raises an :class:`~epikv.errors.AdmissionError` (one line, naming the request field
    to blame) for a bad budget."""
    raw = (extra_args or {}).get(BUDGET_ARG)
    budget = spec.budget
    if raw is not None:
        try:
            budget = spec.row_budget(parse_budget(raw))
        except ValueError as err:
            raise BudgetOutOfRange(f"{BUDGET_ARG}={raw!r}: {err}") from None
    budget = spec.prompt_budget(prompt_tokens, budget)
    cap = spec.cap_tokens(prompt_tokens, budget)
    if cap is None:
        return RequestPlan(None, None, None)
    reserve = cap if max_tokens is None else min(cap, prompt_tokens + max_tokens)
    return RequestPlan(budget, cap, reserve)


def check_pool(plan: RequestPlan, block_size: int, usable_blocks: int, window_blocks: int = 0) -> None:
    """Raise :class:`~epikv.errors.PoolTooSmall` (one line) for a request whose reservation, in
    blocks, and its sliding windows' blocks pass the whole KV pool of one replica: no wait would
    admit it. The one rule of the front end (a 400) and the scheduler (for inputs that come another
    way, and hybrids' windows, which only the scheduler counts)."""
    blocks = -(-(plan.reserve or 0) // block_size)
    if blocks + window_blocks > usable_blocks:
        raise PoolTooSmall(
            f"this request reserves {plan.reserve} tokens ({blocks} blocks of {block_size}"
            + (f", and {window_blocks} for its sliding windows" if window_blocks else "")
            + f"), more than the whole KV pool ({usable_blocks} blocks)"
        )


def model_info(vllm_config: Any) -> ModelInfo:
    """What a policy may know of the served model, from vLLM's model config."""
    model_config = vllm_config.model_config
    identity = getattr(model_config.hf_config, "epikv_model_id", None) or str(model_config.model)
    return hf_model_info(model_config.hf_text_config, identity)


def hf_model_info(hf: Any, identity: str) -> ModelInfo:
    """:class:`ModelInfo` from a transformers text config: what the plugin's spec is built from, and
    what a client outside vLLM (``epikv eval --engine vllm``) builds the same spec from."""
    heads = hf.num_attention_heads
    sliding, window = sliding_layers(hf)
    return ModelInfo(
        identity=identity,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        hidden_size=hf.hidden_size,
        context_length=getattr(hf, "max_position_embeddings", None),
        sliding_layers=sliding,
        window=window,
    )


def check_engine(vllm_config: Any, spec: CacheSpec) -> None:
    """Refuse, with one line, what the plugin does not run (yet): at start-up, never at the first
    compaction."""
    import vllm
    from vllm.platforms import current_platform

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise Refused(
            f"epikv: vLLM {vllm.__version__} is not supported (tested on {VLLM_SERIES}x; the worker "
            "overrides private methods of its model runner)"
        )
    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel, scheduler = vllm_config.parallel_config, vllm_config.scheduler_config
    hf = model.hf_text_config
    evicts, queries = spec.evicts, spec.policy.needs().query_layer is not None
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    window = window_problem(hf, model.hf_config.model_type)
    checks = [
        (
            not current_platform.is_cpu(),
            f"the {current_platform.device_name} platform is not supported: the plugin runs on vLLM's CPU "
            "backend (the GPU path is designed in docs/vllm.md, not built)",
        ),
        (
            evicts and cache.enable_prefix_caching and not spec.policy.protect_prompt,
            f"prefix caching is on, and policy {spec.policy.name!r} may evict prompt tokens, so a prompt's "
            "blocks could change under another request: pass --no-enable-prefix-caching "
            "(enable_prefix_caching=False) or use a policy that protects the prompt",
        ),
        (vllm_config.speculative_config is not None, "speculative decoding is not supported"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism is not supported"),
        (
            (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads)
            % parallel.tensor_parallel_size
            != 0,
            f"tensor parallelism {parallel.tensor_parallel_size} does not divide the model's {kv_heads} KV "
            "heads: vLLM would replicate heads across ranks, which the plugin does not gather",
        ),
        (
            str(cache.cache_dtype) != "auto",
            f"KV cache dtype {cache.cache_dtype!r}: quantized or fp8 KV "
            "is not supported (the layout probe needs exact values)",
        ),
        (
            bool(getattr(model, "use_mla", False)),
            "models with multi-head latent attention (MLA) are not supported yet",
        ),
        (window is not None, str(window)),
        (
            evicts and _uses_alibi(model),
            "ALiBi models are not supported: vLLM's kernels would bias by physical slots, so every "
            "distance is wrong once tokens are evicted",
        ),
        (
            bool(getattr(model, "enable_prompt_embeds", False)),
            "prompt embeddings are not supported (--enable-prompt-embeds): the plugin protects and "
            "counts a prompt by its token ids",
        ),
        (bool(getattr(scheduler, "async_scheduling", False)), "async scheduling is not supported"),
        (vllm_config.kv_transfer_config is not None, "KV connectors are not supported"),
        (
            queries and getattr(vllm_config, "lora_config", None) is not None,
            f"policy {spec.policy.name!r} recomputes queries, which LoRA adapters would change: "
            "LoRA is not supported with it",
        ),
        (
            queries and getattr(model, "quantization", None) is not None,
            f"policy {spec.policy.name!r} recomputes queries through the query projection, which is not "
            f"built for {model.quantization!r} weights; use an unquantized model or a policy without "
            "queries",
        ),
    ]
    for bad, why in checks:
        if bad:
            raise Refused(f"epikv: {why}")
    if spec.policy.needs().hidden_layers and not _has_aux_hidden_states(model):
        raise Refused(
            f"epikv: policy {spec.policy.name!r} reads hidden states through vLLM's EAGLE-3 aux-hidden-"
            f"state path, which vLLM's class for {model.architectures} does not have; run the model on "
            "vLLM's Transformers backend, which has it (--model-impl transformers), or use a policy that "
            "reads none (streaming, keydiff, lagkv, random)"
        )
    kind = model.hf_config.model_type
    native = kind in QUERY_MODELS or (kind in ARCHITECTURES and _on_transformers_backend(model))
    if queries and not native:
        raise Refused(
            f"epikv: policy {spec.policy.name!r} recomputes queries, built for model types "
            f"{sorted(QUERY_MODELS)} in vLLM, not {kind!r}"
        )


QUERY_MODELS = frozenset(
    name
    for name, facts in ARCHITECTURES.items()
    if not facts.rope_by_layer_type and facts.rope_flag is None and not facts.nope_global
)
"""Model types whose queries the plugin recomputes with vLLM's own modules (:mod:`epikv.vllm.queries`):
every layer applies its own RoPE module. Left out: per-layer-kind tables and layers without RoPE
(Gemma 3, EXAONE 4), whose vLLM classes also lack the aux-hidden-state path Seg-Q reads. On vLLM's
Transformers backend the queries follow epikv's engine's path on transformers' modules, every type."""


ALIBI_MODELS = {"bloom", "mpt", "jais", "baichuan"}  # attention biased by distance, not RoPE


def _uses_alibi(model: Any) -> bool:
    hf = model.hf_text_config
    if getattr(hf, "alibi", False) or getattr(hf, "use_alibi", False):
        return True
    if getattr(hf, "position_embedding_type", None) == "alibi":
        return True
    kind = model.hf_config.model_type
    return kind in ALIBI_MODELS and (kind != "baichuan" or getattr(hf, "num_hidden_layers", 0) >= 40)


def _model_class(model: Any) -> type | None:
    """vLLM's class for the model (None when it cannot be resolved here: a stand-in config, or a class
    vLLM cannot load, which then fails on the model itself: not ours to refuse)."""
    try:
        from vllm.model_executor.models import ModelRegistry

        cls, _ = ModelRegistry.resolve_model_cls(model.architectures, model)
    except Exception:
        return None
    return cls


def _on_transformers_backend(model: Any) -> bool:
    cls = _model_class(model)
    return cls is not None and cls.__module__.startswith("vllm.model_executor.models.transformers")


def _has_aux_hidden_states(model: Any) -> bool:
    """Whether vLLM's class for the model has the EAGLE-3 aux-hidden-state path (True when the class
    cannot be resolved here)."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    cls = _model_class(model)
    return cls is None or bool(supports_eagle3(cls))
