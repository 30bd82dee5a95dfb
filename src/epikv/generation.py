"""``generate``: prompts in, text out, under one policy and budget — a client of the engine.

It owns tokenising prompts (chat template or raw text), turning a :class:`SamplingConfig` into
engine requests (row i of a call samples with its own generator, seeded from the config's seed and
the prompt, so a prompt draws the same tokens whatever batch or resume it runs in), and turning
completions' tokens into their text (the :class:`~epikv.engine.Completion` is the one record of a
finished sequence, here as in evaluation), and the :class:`ChatGenerator` that evaluation calls. The
decoding itself is :class:`epikv.engine.Engine`'s.
``model.generate(..., cache=cache)`` works too (see :func:`epikv.attach`; ``past_key_values=cache``
on transformers 5.19).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from epikv.engine import Engine, PromptFit, Request, SamplingParams, prompt_fit
from epikv.integration import build_spec, model_info

if TYPE_CHECKING:
    from epikv.engine import Completion
    from epikv.spec import CacheSpec

Prompt = str | list[dict[str, str]]


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings of a :func:`generate` call; temperature 0 means greedy.

    The engine's :class:`~epikv.engine.SamplingParams` is one request's token-picking rule (no length,
    no EOS, its own seed); this is what a caller asks of a whole call, and :meth:`for_row` gives each
    row its rule."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.for_row(self.seed)  # validates temperature and top_p

    def for_row(self, seed: int) -> SamplingParams:
        """The engine's sampling of one row, seeded with ``seed`` (see :func:`row_seed`)."""
        return SamplingParams(self.temperature, self.top_p, seed)


def encode_prompt_ids(tokenizer: Any, prompts: Sequence[Prompt], chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt. A str prompt is wrapped as one user message when ``chat`` and the
    tokenizer has a chat template; a message list always uses the template."""
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
        rows.append(list(ids))
    return rows


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], chat: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask (B, P), left padded (for ``model.generate`` with a cache)."""
    rows = encode_prompt_ids(tokenizer, prompts, chat)
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


def row_seed(seed: int, ids: Sequence[int], occurrence: int = 0) -> int:
    """The sampling seed of one prompt: stable for (seed, prompt, n-th copy of it in a call)."""
    data = b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids)
    return zlib.crc32(data + occurrence.to_bytes(4, "little"), seed & 0xFFFFFFFF)


def prompt_requests(
    prompt_ids: Sequence[Sequence[int]], sampling: SamplingConfig, stop_ids: Sequence[int]
) -> list[Request]:
    """Engine requests for tokenised prompts under one sampling config."""
    requests, seen = [], {}
    stops = frozenset() if sampling.ignore_eos else frozenset(stop_ids)
    for ids in prompt_ids:
        occurrence = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
        params = sampling.for_row(row_seed(sampling.seed, ids, occurrence))
        requests.append(Request(list(ids), sampling.max_new_tokens, params, stops))
    return requests


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    policy: str | Any = "epikv",
    budget: int | None = None,
    sampling: SamplingConfig | None = None,
    interval: int | None = None,
    chat: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    on_prefill: Callable[[int, int, int], None] | None = None,
    rank_every: int | None = None,
    **policy_params: Any,
) -> list[Completion]:
    """Generate for a batch of prompts under one policy (a name, a policy or a :class:`CacheSpec`)
    and budget; returns one result per prompt. ``on_token(row, token_id)`` streams every token;
    ``on_prefill(row, done, total)`` follows the prefill of a prompt long enough to run in chunks."""
    sampling = sampling or SamplingConfig()
    spec = build_spec(model, policy, budget, interval=interval, params=policy_params, rank_every=rank_every)
    ids = encode_prompt_ids(tokenizer, prompts, chat)
    requests = prompt_requests(ids, sampling, eos_ids(model, tokenizer))
    for row, request in enumerate(requests):
        if on_token is not None:
            request.on_token = lambda token, row=row: on_token(row, token)
        if on_prefill is not None:
            request.on_prefill = lambda done, total, row=row: on_prefill(row, done, total)
    completions = Engine(model, spec).run(requests)
    for completion in completions:
        completion.text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    return completions


class ChatGenerator:
    """Generates for chat prompts with one model under one resolved cache spec: what evaluation calls
    (see ``epikv.eval.generator``). ``fit`` checks prompts by the engine's own rules before any
    generation; ``resolved_policy`` is the policy as the spec resolved it (bands, defaults)."""

    def __init__(self, model: Any, tokenizer: Any, spec: CacheSpec) -> None:
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.resolved_policy: dict[str, Any] = spec.policy.config()
        self.context_length = model_info(model).context_length

    def __call__(self, prompts: Sequence[Prompt], sampling: SamplingConfig) -> list[Completion]:
        return generate(self.model, self.tokenizer, prompts, self.spec, sampling=sampling)

    def fit(self, prompts: Sequence[Prompt]) -> list[PromptFit]:
        """Whether each prompt can run here (the engine's own rules), before any generation."""
        ids = encode_prompt_ids(self.tokenizer, prompts)
        return [prompt_fit(self.spec, self.context_length, len(row)) for row in ids]


def make_generator(
    model_name: str | None,
    policy: str,
    budget: int | None,
    interval: int | None = None,
    policy_params: dict[str, Any] | None = None,
    *,
    dtype: str = "float32",
    rank_every: int | None = None,
) -> ChatGenerator:
    """A :class:`ChatGenerator` for the named model, policy and budget (``rank_every``: rho, see
    :attr:`epikv.spec.CacheSpec.rank_every`). The model is loaded once per process and shared by every
    generator made for it; the spec is resolved here, once, so a profile written while a run goes on
    cannot change its bands midway."""
    from epikv.models import load_model

    model, tokenizer = _loaded(
        (model_name, dtype), lambda: load_model(model_name, dtype=getattr(torch, dtype))
    )
    return ChatGenerator(
        model,
        tokenizer,
        build_spec(model, policy, budget, interval=interval, params=policy_params, rank_every=rank_every),
    )


_MODELS: dict[tuple[str | None, str], tuple[Any, Any]] = {}


def _loaded(key: tuple[str | None, str], loader: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    if key not in _MODELS:
        _MODELS[key] = loader()
    return _MODELS[key]
