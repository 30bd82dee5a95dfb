"""What the engine is asked to do and what it answers: requests, their sampling, their outcome.

A :class:`Request` is one sequence: prompt token ids, how many tokens to produce, how to pick them
(greedy, seeded sampling, or *forced*: teacher forcing feeds given tokens and still reports the
model's logits), when to stop, and optional callbacks. It knows no tokenizer and no model; stop
strings and detokenised streaming belong to the caller's ``on_token``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

_ids = itertools.count()

TokenCallback = Callable[[int], "bool | None"]
"""Called with each chosen token id; returning True stops the request (finish reason ``stop``)."""
LogitsCallback = Callable[[int, torch.Tensor, bool], None]
"""Called before each token is chosen with (index, logits (V,), whether the cache had evicted)."""
PromptLogitsCallback = Callable[[int, torch.Tensor], None]
"""Called during the prefill with (start, logits (q, V)) of prompt positions start..start+q-1 (one
call per forward of a chunked prefill); position i's logits predict prompt token i + 1."""
PrefillCallback = Callable[[int, int], None]
"""Called after each chunk of a prompt too long for one forward with (tokens done, prompt tokens)."""
CompactionCallback = Callable[[int, torch.Tensor], None]
"""Called after the cache compacted the request's row, with (index, positions): index = tokens chosen
so far (the row has then seen prompt + index tokens); positions = (layers, H, L) true positions of the
row's cached slots after the compaction, -1 at holes (H = 1 unless the policy selects per head)."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; otherwise temperature + nucleus (top_p) sampling from a generator
    seeded with ``seed``, one per request, so a request draws the same tokens in any batch."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    """One sequence for the engine.

    prompt_ids: the prompt's token ids (at least one). max_new_tokens: tokens to produce (with
    ``forced``, at most its length). stop_ids: token ids that end the request (EOS; empty to ignore
    EOS). forced: tokens fed instead of chosen ones (teacher forcing); the model's logits still reach
    ``on_logits``. on_prefill: progress of a long prompt's prefill (see ``PrefillCallback``).
    on_compaction: observes what the cache kept (for studies; costs nothing when None).
    on_prompt_logits: hears every prompt position's logits from the prefill's own forwards (echoed
    prompt log-probabilities; projects every position onto the vocabulary, so only when set).
    budget: this request's own K, in 1..the spec's (None = the spec's; the engine's gate checks it,
    :class:`~epikv.engine.admission.Admission`). prefix: a cache (batch 1,
    nothing evicted) whose first ``prefix_length`` slots precede ``prompt_ids``.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    forced: Sequence[int] | None = None
    budget: int | None = None
    on_token: TokenCallback | None = None
    on_logits: LogitsCallback | None = None
    on_prefill: PrefillCallback | None = None
    on_compaction: CompactionCallback | None = None
    on_prompt_logits: PromptLogitsCallback | None = None
    prefix: Any = None
    prefix_length: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.forced is not None:
            if not self.forced:
                raise ValueError("forced tokens must not be empty")
            self.max_new_tokens = min(self.max_new_tokens, len(self.forced))
        self.stop_ids = frozenset(self.stop_ids)

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_length + len(self.prompt_ids)


@dataclass
class Completion:
    """What one request produced and what the cache did while it ran: the one record of a finished
    sequence, from the engine through ``generate`` to evaluation.

    finish_reason: ``eos`` (a stop id), ``stop`` (``on_token`` asked), ``length``, or ``cancelled``.
    first_evicted_index: index of the first token chosen from logits of a cache that had already
    evicted (None if it never did). seconds: from the request's prefill to its last token.
    mean_cache_tokens: tokens the row held per decode step, averaged (None if it never decoded).
    budget: the K the request ran at: its own or the spec's, raised for a prompt whose protected
    tokens pass it (:meth:`~epikv.spec.CacheSpec.prompt_budget`; None: it never evicts).
    text: the tokens decoded, set by a client that has the tokenizer (``generate``); the engine
    knows none and leaves it empty.
    """

    request_id: int
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    peak_cache_tokens: int
    final_cache_tokens: int
    evictions: int
    compactions: int
    first_evicted_index: int | None
    prefill_seconds: float
    seconds: float
    mean_cache_tokens: float | None = None
    text: str = ""
    budget: int | None = None

    @property
    def tokens_generated(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict[str, Any]:
        """Every field, and ``tokens_generated``, as JSON-ready values."""
        return {**asdict(self), "tokens_generated": self.tokens_generated}
