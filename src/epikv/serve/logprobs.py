"""Log-probabilities of one request, taken from the engine's own forwards, and their OpenAI shapes.

A :class:`LogprobRecorder` listens to the engine (in the engine thread): ``on_logits`` receives each
step's logits before the token is chosen (the same forward that chooses it, so nothing runs twice),
the chosen token then takes its log-probability and the ``top`` most likely alternatives from them;
``on_prompt_logits`` receives the prefill's logits of every prompt position (asked for only when the
prompt is echoed). Log-probabilities are the model's own distribution, log_softmax of the logits,
before temperature or top_p (as vLLM reports them by default).

:func:`chat_logprobs` and :func:`completion_logprobs` turn those records into the bodies of
``/v1/chat/completions`` (``{"content": [...]}``) and ``/v1/completions`` (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``). It knows nothing of HTTP or the engine's
internals; token text comes from the tokenizer it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability and the ``top`` most likely tokens at its position (id, logprob),
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class LogprobRecorder:
    """Records every chosen (and, with ``prompt_ids``, every prompt) token's log-probability."""

    top: int
    prompt_ids: Sequence[int] | None = None
    tokens: list[TokenLogprob] = field(default_factory=list)
    prompt: list[TokenLogprob | None] = field(default_factory=list)
    _pending: torch.Tensor | None = field(default=None, init=False, repr=False)
    _sent: int = field(default=0, init=False, repr=False)

    def on_logits(self, index: int, logits: torch.Tensor, evicted: bool) -> None:
        self._pending = logits

    def chosen(self, token: int) -> None:
        """The token the engine just chose from the logits :meth:`on_logits` received."""
        if self._pending is None:
            raise RuntimeError("a token was chosen before its logits arrived")
        logits, self._pending = self._pending[None], None
        self.tokens.append(_rows(logits, torch.tensor([token], device=logits.device), self.top)[0])

    def on_prompt_logits(self, start: int, logits: torch.Tensor) -> None:
        """(start, logits (q, V)) of prompt positions start..start+q-1: each predicts the next prompt
        token; the first prompt token has no log-probability (None)."""
        ids = list(self.prompt_ids or ())
        if start == 0:
            self.prompt = [None]
        count = min(logits.shape[0], len(ids) - 1 - start)  # the last position predicts a new token
        if count > 0:
            targets = torch.tensor(ids[start + 1 : start + 1 + count], device=logits.device)
            self.prompt.extend(_rows(logits[:count], targets, self.top))

    def flush(self) -> list[TokenLogprob]:
        """The chosen tokens' records not taken yet (for a streamed chunk)."""
        out, self._sent = self.tokens[self._sent :], len(self.tokens)
        return out


def _rows(logits: torch.Tensor, targets: torch.Tensor, top: int) -> list[TokenLogprob]:
    """log_softmax of each row of logits (n, V) at its target, with its ``top`` largest: no second
    (n, V) tensor (the log-normaliser is subtracted from the few values kept)."""
    values = logits.float()
    norm = torch.logsumexp(values, dim=-1, keepdim=True)
    chosen = (values.gather(-1, targets[:, None]) - norm)[:, 0].tolist()
    if top:
        best_values, best_ids = values.topk(top, dim=-1)
        best = zip((best_values - norm).tolist(), best_ids.tolist(), strict=True)
        tops = [tuple(zip(i, v, strict=True)) for v, i in best]
    else:
        tops = [()] * len(chosen)
    return [
        TokenLogprob(int(t), float(lp), top_row)
        for t, lp, top_row in zip(targets.tolist(), chosen, tops, strict=True)
    ]


class TokenText:
    """Each token id's own text (decoded alone, special tokens kept), remembered."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.seen: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.seen.get(token)
        if text is None:
            text = self.seen[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def chat_logprobs(records: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or of one streamed chunk)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", errors="replace"))}

    content = [
        {**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    records: Sequence[TokenLogprob | None], text: TokenText, offset: int = 0, prompt_ids: Sequence[int] = ()
) -> dict[str, Any]:
    """``choice.logprobs`` of a text completion: ``prompt_ids`` pairs the echoed prompt's records (its
    first is None) with their tokens; each ``top_logprobs`` holds the ``top`` best and the token itself
    (as vLLM does); ``text_offset`` counts characters from ``offset``."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for index, record in enumerate(records):
        token = record.token if record is not None else int(prompt_ids[index])
        tokens.append(text(token))
        offsets.append(offset)
        offset += len(tokens[-1])
        if record is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(record.logprob)
        best = {text(t): lp for t, lp in record.top}
        best.setdefault(tokens[-1], record.logprob)
        tops.append(best)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
