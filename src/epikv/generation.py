"""Our decode loop: batched, left-padded, greedy or sampled, one budgeted cache per batch.

It owns tokenising prompts (chat template or raw text), the step loop, stopping, and turning the
cache's counters into per-sequence results. It does not know any policy: it only attaches one.
``model.generate(..., cache=cache)`` works too (see :func:`epikv.attach`); this loop adds
per-sequence results, streaming and sampling with a seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from epikv.integration import attach

Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; temperature 0 means greedy."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class SequenceResult:
    """One generated sequence and what the cache did while writing it."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    tokens_generated: int
    finish_reason: str  # "eos" | "length"
    peak_cache_tokens: int
    final_cache_tokens: int
    evictions: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], chat: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask (B, P), left padded. A str prompt is wrapped as one user message
    when ``chat`` and the tokenizer has a chat template; a message list always uses the template."""
    if not prompts:
        raise ValueError("no prompts given")
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(f"prompt {i} is empty")
        use_template = not isinstance(prompt, str) or (chat and getattr(tokenizer, "chat_template", None))
        if use_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {i} encodes to no tokens")
        rows.append(ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return input_ids, mask


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    found: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            found.add(source)
        elif source:
            found.update(int(s) for s in source)
    return sorted(found)


def next_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """Greedy argmax, or temperature + nucleus sampling from (B, V) logits."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > sampling.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    policy: Any = "epikv",
    budget: int | None = None,
    sampling: SamplingConfig | None = None,
    interval: int | None = None,
    chat: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    **policy_params: Any,
) -> list[SequenceResult]:
    """Generate for a batch of prompts under one policy and budget; returns one result per prompt.

    ``on_token(row, token_id)`` is called for every generated token (streaming)."""
    sampling = sampling or SamplingConfig()
    device = next(model.parameters()).device
    input_ids, mask = encode_prompts(tokenizer, prompts, chat)
    input_ids, mask = input_ids.to(device), mask.to(device)
    stop = torch.tensor(eos_ids(model, tokenizer) or [-1], device=device)
    generator = torch.Generator().manual_seed(sampling.seed)
    batch = input_ids.shape[0]
    out = torch.zeros(batch, sampling.max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long, device=device)
    final_stats: dict[int, Any] = {}
    start = time.perf_counter()
    with attach(model, policy, budget=budget, interval=interval, **policy_params) as cache:
        logits = model(
            input_ids=input_ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1
        ).logits
        for step in range(sampling.max_new_tokens):
            token = next_tokens(logits[:, -1], sampling, generator)
            token = torch.where(done, stop[0].clamp_min(0), token)
            out[:, step] = token
            if on_token is not None:
                for row in range(batch):
                    if not done[row]:
                        on_token(row, int(token[row]))
            if not sampling.ignore_eos:
                hit = torch.isin(token, stop) & ~done
                if bool(hit.any()):
                    lengths = torch.where(hit, step + 1, lengths)
                    done = done | hit
                    _snapshot(cache.stats(), hit, final_stats)
                    if bool(done.all()):
                        break
            if step + 1 < sampling.max_new_tokens:
                logits = model(input_ids=token[:, None], cache=cache, use_cache=True).logits
        stats = [final_stats.get(row, st) for row, st in enumerate(cache.stats())]
    seconds = time.perf_counter() - start
    return _results(tokenizer, out, lengths, done, stats, seconds)


def _snapshot(stats: list, rows: torch.Tensor, into: dict[int, Any]) -> None:
    """Freeze the cache counters of rows that just finished (later steps only feed padding)."""
    for row in rows.nonzero().flatten().tolist():
        into[row] = stats[row]


def _results(
    tokenizer: Any, out: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor, stats: list, seconds: float
) -> list[SequenceResult]:
    results = []
    for row, st in enumerate(stats):
        n = int(lengths[row])
        ids = out[row, :n].tolist()
        results.append(
            SequenceResult(
                text=tokenizer.decode(ids, skip_special_tokens=True),
                token_ids=ids,
                prompt_tokens=st.prompt_tokens,
                tokens_generated=n,
                finish_reason="eos" if bool(done[row]) else "length",
                peak_cache_tokens=st.peak_cache_tokens,
                final_cache_tokens=st.final_cache_tokens,
                evictions=st.evictions,
                seconds=seconds,
            )
        )
    return results


Generator = Callable[[list[list[dict[str, str]]], SamplingConfig], list[SequenceResult]]


def make_generator(
    model_name: str | None,
    policy: str,
    budget: int | None,
    interval: int | None = None,
    policy_params: dict[str, Any] | None = None,
) -> Generator:
    """A callable that generates for chat prompts with the named model, policy and budget bound.

    The model is loaded once per process and shared by every generator made for it."""
    from epikv.integration import resolve_policy
    from epikv.models import load_model

    model, tokenizer = _loaded(model_name, load_model)
    # Resolved once, so a profile written while a run goes on cannot change its bands midway.
    resolved = resolve_policy(model, policy, **(policy_params or {}))

    def run(prompts: list[list[dict[str, str]]], sampling: SamplingConfig) -> list[SequenceResult]:
        return generate(model, tokenizer, prompts, resolved, budget, sampling, interval)

    run.resolved_policy = resolved.config()  # type: ignore[attr-defined]
    return run


_MODELS: dict[str | None, tuple[Any, Any]] = {}


def _loaded(name: str | None, loader: Callable[[str | None], tuple[Any, Any]]) -> tuple[Any, Any]:
    if name not in _MODELS:
        _MODELS[name] = loader(name)
    return _MODELS[name]
