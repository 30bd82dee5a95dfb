"""The run spec: how one cache evicts — the policy resolved for a model, the budget, the interval,
where attention rows come from — built once, by one constructor, for every command.

:meth:`CacheSpec.build` alone owns what a budget value means (a positive number of tokens; a policy
that never evicts has none, whatever was asked), the no-eviction rule, parsing ``key=value`` policy
parameters by the policy's own field types, and the band lookup (the model's profile is handed to
the policy as data; policies never read files). It also answers the questions callers used to
answer each in their own way: the smallest budget a prompt can run under, and how many cache slots
a request may hold at its peak (what a server reserves). It knows no model modules, only
:class:`~epikv.policies.base.ModelInfo`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from epikv.errors import BudgetOutOfRange, BudgetTooSmall
from epikv.policies.base import Bands, ModelInfo, Policy
from epikv.policies.registry import get_policy, policy_class
from epikv.selection import Selection, protected_slots, select_keep

RANK_EVERY_HELP = (  # every command's --rank-every (CacheSpec.rank_every)
    "rho: with interval 1, score the cache every N decode steps and evict one token a step in between "
    "from that ranking, into whose slot the next token goes (peak K + 1); default: score at every eviction"
)

ATTENTION_MODES = ("recompute", "eager")
"""Where attention rows come from (:mod:`epikv.integration.attention`); every command offers these."""


@dataclass(frozen=True)
class CacheSpec:
    """policy: resolved for the model; budget: K tokens per sequence (None = no eviction);
    interval: compaction interval tau; attention: where attention rows come from for policies that
    read them (None for the others); bands: the band profile used, with its origin (banded policies);
    rank_every: rho (issue 56; None: every eviction scores), with tau = 1: a row scores its cache every
    rho steps and in between evicts its lowest-ranked token still present (:mod:`epikv.cache.ranked`)."""

    policy: Policy
    budget: int | None
    interval: int
    attention: str | None = None
    bands: Bands | None = None
    rank_every: int | None = None

    @classmethod
    def build(
        cls,
        model: ModelInfo,
        policy: str | Policy = "epikv",
        budget: int | str | None = None,
        *,
        interval: int | None = None,
        attention: str = "recompute",
        params: Mapping[str, Any] | Sequence[str] | None = None,
        rank_every: int | str | None = None,
    ) -> CacheSpec:
        """The one way to make a spec. ``params`` are policy hyperparameters, as a mapping or as
        ``key=value`` strings (parsed by the field's type); ``interval`` is the ``interval`` one;
        ``rank_every`` (rho) needs tau = 1 and sets it when no interval is asked."""
        cls_ = type(policy) if isinstance(policy, Policy) else policy_class(policy)
        values = parse_policy_params(cls_, params or {})
        if interval is not None:
            values["interval"] = interval
        if (rank_every := parse_rank_every(rank_every, values.get("interval"))) is not None:
            values["interval"] = 1
        chosen = get_policy(policy, **values)
        bands = _bands_for(chosen, model)
        resolved = chosen.resolve(model, bands)
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        reads_attention = bool(resolved.needs().attention_layers)
        k = parse_budget(budget) if resolved.evicts else None
        if resolved.evicts and k is None:
            raise ValueError(f"policy {resolved.name!r} evicts and needs a budget (tokens), got None")
        rho = rank_every if resolved.evicts else None  # a policy that keeps every token never ranks
        return cls(resolved, k, resolved.interval, attention if reads_attention else None, bands, rho)

    # -- what a budget can hold ------------------------------------------------------------------
    @property
    def evicts(self) -> bool:
        return self.budget is not None

    def protected_tokens(self, prompt_tokens: int, budget: int | None = None) -> int:
        """Tokens no eviction may drop at budget K: the prompt (or the sinks) plus the recent window."""
        k = self.budget if budget is None else budget
        first = prompt_tokens if self.policy.protect_prompt else min(self.policy.n_sink, prompt_tokens)
        return first + self.policy.recent_window(k)

    def min_budget(self, prompt_tokens: int) -> int:
        """The smallest K whose protected tokens fit in K (the recent window grows with K)."""
        k = 1
        while self.protected_tokens(prompt_tokens, k) > k:
            # K - recent(K) grows with K, so stepping up finds the first K that fits.
            k = max(k + 1, self.protected_tokens(prompt_tokens, k) - self.policy.recent_window(k))
        return k

    def prompt_budget(self, prompt_tokens: int, budget: int | None = None) -> int | None:
        """The K a sequence with this prompt runs at on every host: ``budget`` (None = the spec's),
        raised to :meth:`min_budget` when the prompt's protected tokens (the prompt or the sinks, and
        the recent window) pass it. Such a row keeps its protected tokens and evicts what it generates
        past its recent window; its books report the raised K. None: the spec never evicts."""
        k = self.budget if budget is None else budget
        if k is None:
            return None
        return max(k, self.min_budget(prompt_tokens))

    def check_prompt(self, prompt_tokens: int, budget: int | None = None) -> None:
        """Raise :class:`BudgetTooSmall` (with the smallest budget that works) if the prompt cannot run
        at K itself (:meth:`prompt_budget` would raise K): the strict rule of comparisons at equal K
        (``epikv eval`` skips such a problem)."""
        k = self.budget if budget is None else budget
        if k is None:
            return
        needed = self.protected_tokens(prompt_tokens, k)
        if needed <= k:
            return
        p = self.policy
        what = "prompt" if p.protect_prompt else f"{p.n_sink} sinks"
        first = prompt_tokens if p.protect_prompt else min(p.n_sink, prompt_tokens)
        smallest = self.min_budget(prompt_tokens)
        raise BudgetTooSmall(
            f"budget {k} cannot hold the protected tokens of policy {p.name!r}: {what} ({first}) + recent "
            f"window ({p.recent_window(k)}) = {needed}; the smallest budget that holds them is {smallest}",
            smallest,
        )

    def select(
        self,
        scores: torch.Tensor,
        positions: torch.Tensor,
        prompt_len: torch.Tensor,
        seen: torch.Tensor,
        valid: torch.Tensor,
        budgets: Sequence[int],
    ) -> Selection:
        """The one keep rule, for every host (the budgeted cache, the vLLM plugin): the policy's
        ``scores`` (G, B, H, L) over slots at true ``positions`` (G', B, H', L; -1 at holes), with the
        prompt (or sinks) and each row's recent window protected, top-K per row at ``budgets`` (B,)."""
        device = scores.device
        recent = torch.tensor([self.policy.recent_window(k) for k in budgets], device=device)
        protected = protected_slots(
            positions if scores.shape[0] > 1 else positions[:1],
            prompt_len,
            seen,
            protect_prompt=self.policy.protect_prompt,
            n_sink=self.policy.n_sink,
            recent=recent,
        )
        return select_keep(scores, protected, valid, torch.tensor(list(budgets), device=device))

    def row_budget(self, budget: int | None) -> int | None:
        """A row's K: ``budget`` (a request's own, at most the spec's), or the spec's when None."""
        if budget is None:
            return self.budget
        if self.budget is None:
            raise BudgetOutOfRange(
                f"policy {self.policy.name!r} keeps every token: a request budget cannot be set"
            )
        if not 0 < budget <= self.budget:
            raise BudgetOutOfRange(
                f"a request's budget must be in 1..{self.budget}, at most the engine's (its spec's K), "
                f"got {budget}"
            )
        return budget

    @property
    def first_since(self) -> int:
        """A new row's count of decode steps "since its last compaction": 0 when the policy's first
        compaction waits tau decode steps (``after_interval``), tau when it may come right after the
        prefill. Every host starts its books with it (:meth:`RowBooks.due` reads the count)."""
        return 0 if self.policy.first_compaction == "after_interval" else self.interval

    def cap_tokens(self, prompt_tokens: int, budget: int | None = None) -> int | None:
        """Most cache slots one sequence ever holds, however long it generates (None: it never evicts),
        at its :meth:`prompt_budget` K. A prompt longer than K is held whole until its first
        compaction, which comes right after the prefill (then at most max(P, K + tau)) or tau decode
        steps later (``after_interval``: at most max(P, K) + tau). What a host reserves and checks, on
        every host."""
        k = self.prompt_budget(prompt_tokens, budget)
        if k is None:
            return None
        if self.policy.first_compaction == "after_interval":
            return max(prompt_tokens, k) + self.interval
        return max(prompt_tokens, k + self.interval)

    def peak_tokens(self, prompt_tokens: int, max_new_tokens: int, budget: int | None = None) -> int:
        """Most cache slots one sequence of ``max_new_tokens`` can hold: prompt + generated tokens,
        capped by :meth:`cap_tokens` once it evicts."""
        total = prompt_tokens + max_new_tokens
        cap = self.cap_tokens(prompt_tokens, budget)
        return total if cap is None else min(total, cap)

    def config(self) -> dict[str, Any]:
        """The resolved spec as saved next to results (``rank_every`` only when set: old records match)."""
        bands = dataclasses.asdict(self.bands) if self.bands is not None else None
        ranking = {} if self.rank_every is None else {"rank_every": self.rank_every}
        return {
            "policy": self.policy.config(),
            "budget": self.budget,
            "interval": self.interval,
            "attention": self.attention,
            "bands": bands,
        } | ranking

    def record(self) -> dict[str, Any]:
        """What a result keeps about this spec: its line (:meth:`describe`) and its resolved config,
        JSON-normalised (tuples as lists)."""
        return {"describe": self.describe(), **json.loads(json.dumps(self.config()))}

    def describe(self) -> str:
        """One line for logs: policy, budget, interval and (for EpiKV) the bands and their origin."""
        text = f"policy={self.policy.name} budget={self.budget or 'none'} interval={self.interval}"
        text += "" if self.rank_every is None else f" rank_every={self.rank_every}"
        if self.bands is not None:
            text += f" bands A={self.bands.band_a} B={self.bands.band_b} ({self.bands.origin})"
        return text


def precheck(
    policy: str,
    budget: int | str | None,
    params: Sequence[str] = (),
    interval: int | None = None,
    rank_every: int | str | None = None,
) -> int | None:
    """The model-free part of :meth:`CacheSpec.build`, which every command line runs before it loads
    a model: the policy's name and ``key=value`` parameters, ``rank_every`` with the interval, and the
    budget (None for a policy that keeps every token, whatever was asked). A ValueError names it."""
    kind = policy_class(policy)
    values = parse_policy_params(kind, params)
    parse_rank_every(rank_every, interval if interval is not None else values.get("interval"))
    return parse_budget(budget) if kind.evicts else None


def parse_rank_every(value: int | str | None, interval: int | None = None) -> int | None:
    """rho: None (score at every eviction), or a positive number of decode steps (int or digits); it
    needs the interval tau = 1 (None: not asked, then set to 1). A ValueError names the bad value."""
    if value is None:
        return None
    rho = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(rho, bool) or not isinstance(rho, int) or rho < 1:
        raise ValueError(f"rank_every must be a positive number of decode steps, got {value!r}")
    if interval not in (None, 1):
        msg = f"rank_every evicts one token a step and needs interval 1, got interval={interval}"
        raise ValueError(f"{msg} with rank_every={rho}")
    return rho


def parse_budget(value: int | str | None) -> int | None:
    """A budget: a positive number of tokens (int or digits), or None. One meaning everywhere:
    0, negatives and words are refused; a policy that keeps everything is ``full``, not a budget."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise ValueError(
                f"budget must be a positive number of tokens, got {value!r}; "
                "to keep every token use the policy 'full' (it needs no budget)"
            )
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"budget must be a positive number of tokens, got {value!r}; "
            "to keep every token use the policy 'full' (it needs no budget)"
        )
    return value


def peak_for_budget(budget: int, interval: int, length: int | None = None) -> int:
    """Peak cached tokens of a policy that lets the cache grow to K + tau and compacts back to K every
    tau steps once over budget (e.g. ``epikv``: K=256, tau=128 -> 384; ``streaming``: tau=1 -> 257).
    ``length`` (prompt + generated tokens) caps it for a sequence that never reaches K + tau."""
    if budget < 1 or interval < 1:
        raise ValueError(f"budget and interval must be >= 1, got {budget} and {interval}")
    peak = budget + interval
    return peak if length is None else min(peak, length)


def budget_for_peak(peak: int, interval: int, min_budget: int = 1) -> int:
    """The budget K whose peak K + tau equals ``peak`` (the inverse of :func:`peak_for_budget`): the one
    place equal peak memory is turned into a budget.

    Raises:
        ValueError: K = peak - tau is below ``min_budget`` (e.g. the prompt plus recent window the
            policy protects): the policy cannot run at that peak.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    budget, floor = peak - interval, max(1, min_budget)
    if budget < floor:
        raise ValueError(f"peak {peak} - tau {interval} leaves budget {budget}, below the minimum {floor}")
    return budget


def budget_at_peak(
    policy: str, peak: int, interval: int | None = None, params: Mapping[str, Any] | None = None
) -> int:
    """The K at which ``policy`` holds at most ``peak`` tokens (equal peak memory): peak - tau, tau
    being ``interval``, an ``interval`` parameter, or the policy's own (1 for one that compacts every
    step). A ValueError names the peak when nothing is left for K."""
    tau = interval or (params or {}).get("interval") or policy_class(policy)().interval
    if peak - tau < 1:
        raise ValueError(f"peak {peak} is not above {policy}'s interval tau = {tau}: no budget is left")
    return budget_for_peak(peak, tau)


def _bands_for(policy: Policy, model: ModelInfo) -> Bands | None:
    """The model's band profile for a policy that reads bands and does not set both itself."""
    if not policy.uses_bands:
        return None
    if getattr(policy, "band_a", None) is not None and getattr(policy, "band_b", None) is not None:
        return Bands(policy.band_a, policy.band_b, "set as parameters")  # type: ignore[attr-defined]
    from epikv.profiles import locate_profile

    profile, origin = locate_profile(model.identity, model.num_layers)
    return Bands(profile.band_a, profile.band_b, origin)


# -- typed policy parameters ---------------------------------------------------------------------
_TRUE, _FALSE, _NONE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}, {"none", "null"}


def parse_policy_params(policy: type[Policy], params: Mapping[str, Any] | Sequence[str]) -> dict[str, Any]:
    """Policy parameters by the policy's dataclass field types. Strings (``key=value`` items or
    mapping values) are parsed by type — bool true/false/yes/no/1/0, int, float, None as none/null,
    tuples as ``1,2,3`` — and anything that does not parse is refused naming the bad value."""
    if isinstance(params, Mapping):
        pairs = list(params.items())
    else:
        pairs = []
        for item in params:
            key, sep, raw = str(item).partition("=")
            if not sep or not key.strip():
                raise ValueError(f"policy parameter must look like KEY=VALUE, got {item!r}")
            pairs.append((key.strip(), raw.strip()))
    hints = typing.get_type_hints(policy)
    known = [f.name for f in dataclasses.fields(policy)]
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=2)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{policy.name}: unknown parameter {key!r}{hint} (known: {', '.join(known)})")
        out[key] = _coerce(policy.name, key, hints[key], value) if isinstance(value, str) else value
    return out


def _coerce(policy: str, key: str, kind: Any, raw: str) -> Any:
    options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    text = raw.strip()
    if type(None) in options and text.lower() in _NONE:
        return None
    for option in (o for o in options if o is not type(None)):
        try:
            return _parse_as(option, text)
        except ValueError:
            continue
    names = " or ".join(_type_name(o) for o in options)
    raise ValueError(f"{policy}: parameter {key}={raw!r} is not {names}")


def _parse_as(kind: Any, text: str) -> Any:
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(text)
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if kind is str:
        return text
    if typing.get_origin(kind) is tuple:
        (item,) = {a for a in typing.get_args(kind) if a is not Ellipsis}
        parts = [p for p in text.strip("[]() ").replace(" ", ",").split(",") if p]
        return tuple(_parse_as(item, p) for p in parts)
    raise ValueError(text)


def _type_name(kind: Any) -> str:
    if kind is type(None):
        return "none"
    if typing.get_origin(kind) is tuple:
        return "a comma-separated list of " + _type_name(typing.get_args(kind)[0]) + "s"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "text"}.get(
        kind, str(kind)
    )
