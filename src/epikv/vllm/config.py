"""The plugin's settings: what ``additional_config["epikv"]`` may hold, the run spec built from it for
the served model, and the one request rule every side of vLLM plans by (:func:`plan_request`,
:func:`check_pool`). The start-up refusals are :mod:`epikv.vllm.refusals`'.

Knows vLLM only through the config object handed in, so it is testable without an engine.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from epikv.errors import AdmissionError, BudgetOutOfRange, PoolTooSmall
from epikv.policies.base import ModelInfo
from epikv.spec import CacheSpec, parse_budget, parse_rank_every

KEY = "epikv"  # the key of ``additional_config`` the plugin reads
WORKER = "epikv.vllm.runner.EpiKVCPUWorker"
SCHEDULER = "epikv.vllm.scheduler.EpiKVScheduler"


class Refused(RuntimeError):
    """A configuration the plugin cannot run; the message is one line saying what and why."""


@dataclass(frozen=True)
class EpiKVSettings:
    """policy: an epikv policy name; budget: K tokens per request (None for ``full``); interval: tau
    (None = the policy's own); params: policy hyperparameters; trace: a JSONL file the worker
    appends each compaction's kept positions to (tests and studies; None = off); rank_every: rho
    (:attr:`CacheSpec.rank_every`, issue 56; None = score at every eviction): with tau = 1, a request
    scores its cache every rho steps and in between evicts its lowest-ranked token (one token moved
    per layer group and head, :mod:`epikv.vllm.ranking`)."""

    policy: str = "epikv"
    budget: int | None = None
    interval: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None
    rank_every: int | None = None

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
            rank_every=value.get("rank_every"),
        )

    def as_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        for name in ("budget", "interval", "trace", "rank_every"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.params:
            out["params"] = dict(self.params)
        return out

    def spec(self, model: ModelInfo) -> CacheSpec:
        """The run spec for the served model; refuses policies that read attention rows."""
        try:
            spec = CacheSpec.build(
                model,
                self.policy,
                self.budget,
                interval=self.interval,
                params=self.params,
                rank_every=self.rank_every,
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

    return [n for n in policy_names() if not policy_class(n).reads_attention]


BUDGET_ARG = "epikv_budget"  # SamplingParams.extra_args key (``vllm_xargs`` in an OpenAI request body)
RANK_EVERY_ARG = "epikv_rank_every"  # the same, for a request's own rho
REQUEST_FIELDS = {"budget": BUDGET_ARG, "rank_every": RANK_EVERY_ARG, "max_new_tokens": "max_tokens"}
"""The OpenAI request parameter an :class:`~epikv.errors.AdmissionError`'s ``field`` blames (any
other field: the prompt's, as the endpoint names it)."""


@dataclass(frozen=True)
class RequestPlan:
    """What one request may hold: budget, its K (None: never evicts); cap, the most physical tokens
    it ever holds (:meth:`CacheSpec.cap_tokens`); reserve, what admission charges it, the spec's peak
    (:meth:`CacheSpec.peak_tokens`) of what vLLM lets it generate (None: nothing reserved, it grows
    as in plain vLLM). Its rho (:func:`request_rank_every`) changes none of them."""

    budget: int | None
    cap: int | None
    reserve: int | None


def plan_request(
    spec: CacheSpec,
    prompt_tokens: int,
    max_tokens: int | None,
    extra_args: Mapping[str, Any] | None,
    max_model_len: int | None = None,
) -> RequestPlan:
    """The one rule for a request on both sides of vLLM (front end, scheduler, worker): its budget
    (``extra_args["epikv_budget"]``, 1..the server's K, or the server's K; raised for a prompt whose
    protected tokens pass it: :meth:`~epikv.spec.CacheSpec.prompt_budget`), its cap and its
    reservation: the spec's peak (:meth:`~epikv.spec.CacheSpec.peak_tokens`) of the tokens vLLM lets
    it generate, ``max_tokens`` clamped as vLLM clamps them (a request stops at ``max_model_len``
    tokens, prompt included; None: no context limit, outside vLLM). So a reservation never passes
    ``max_model_len``, nor the runner's block-table row of cdiv(max_model_len, block) blocks. Raises
    an :class:`~epikv.errors.AdmissionError` (one line, naming the request field to blame) for a bad
    budget, or a rho :func:`request_rank_every` refuses."""
    request_rank_every(spec, extra_args)
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
    new = max_tokens
    if max_model_len is not None:
        room = max(0, max_model_len - prompt_tokens)
        new = room if new is None else min(new, room)
    reserve = cap if new is None else spec.peak_tokens(prompt_tokens, new, budget)
    return RequestPlan(budget, cap, reserve)


def request_rank_every(spec: CacheSpec, extra_args: Mapping[str, Any] | None) -> int | None:
    """A request's rho: ``extra_args["epikv_rank_every"]`` (a positive int, by
    :func:`~epikv.spec.parse_rank_every`), or the server's (None: it scores at every eviction).
    Taken only where the server evicts at tau = 1, so the request's peak stays K + 1 and its
    :func:`plan_request` is the one it has without it (which checks it on every side); elsewhere an
    :class:`~epikv.errors.AdmissionError` whose ``field`` is ``rank_every``."""
    raw = (extra_args or {}).get(RANK_EVERY_ARG)
    if raw is None:
        return spec.rank_every
    try:
        if not spec.evicts:
            raise ValueError(f"policy {spec.policy.name!r} keeps every token: a request cannot rank it")
        return parse_rank_every(raw, spec.interval)
    except ValueError as err:
        refused = AdmissionError(f"{RANK_EVERY_ARG}={raw!r}: {err}")
        refused.field = "rank_every"
        raise refused from None


def longest_request(spec: CacheSpec, max_model_len: int) -> int:
    """The most tokens one request can hold in an engine of context ``max_model_len``: the plan of
    the longest prompt vLLM admits (max_model_len - 1 tokens, then one new token). A prompt is held
    whole until its first compaction, so this is max_model_len, or a token less: what vLLM's
    start-up check and auto-fit must see, as for plain vLLM (the cap bounds how many requests share
    the pool, not how long a context one request brings)."""
    prompt = max(0, max_model_len - 1)
    return plan_request(spec, prompt, 1, None, max_model_len).reserve or max_model_len


def check_pool(
    spec: CacheSpec,
    plan: RequestPlan,
    prompt_tokens: int,
    block_size: int,
    usable_blocks: int,
    window_blocks: int = 0,
) -> None:
    """Raise :class:`~epikv.errors.PoolTooSmall` (one line) for a request whose reservation, in
    blocks, and its sliding windows' blocks pass the whole KV pool of one replica: no wait would
    admit it. It blames the prompt (``field`` "prompt") when the prompt with one new token already
    passes the pool, so no ``max_tokens`` would do, and ``max_tokens`` otherwise. The one rule of the
    front end (a 400) and the scheduler (for inputs that come another way, and hybrids' windows,
    which only the scheduler counts)."""
    blocks = -(-(plan.reserve or 0) // block_size)
    if blocks + window_blocks <= usable_blocks:
        return
    least = spec.peak_tokens(prompt_tokens, 1, plan.budget)
    windows = f", and {window_blocks} for its sliding windows" if window_blocks else ""
    if -(-least // block_size) + window_blocks > usable_blocks:
        err = PoolTooSmall(
            f"a prompt of {prompt_tokens} tokens holds {least} tokens with its first new one "
            f"({-(-least // block_size)} blocks of {block_size}{windows}), more than the whole KV pool "
            f"({usable_blocks} blocks)"
        )
        err.field = "prompt"
        raise err
    raise PoolTooSmall(
        f"this request reserves {plan.reserve} tokens ({blocks} blocks of {block_size}{windows}), more "
        f"than the whole KV pool ({usable_blocks} blocks)"
    )


def model_info(vllm_config: Any) -> ModelInfo:
    """What a policy may know of the served model, from vLLM's model config."""
    model_config = vllm_config.model_config
    identity = getattr(model_config.hf_config, "epikv_model_id", None) or str(model_config.model)
    return ModelInfo.from_config(model_config.hf_text_config, identity)
