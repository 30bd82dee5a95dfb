"""Token ids to streamed text, and stop strings, for one request.

Decoding grows one token at a time, so text is produced incrementally: the ids since a lagging
offset are decoded and compared with the text of the same window one token earlier (a token may end
in the middle of a multi-byte character, which decodes to U+FFFD until the next one arrives; a
window that starts a few tokens back keeps word-initial spaces right). Stop strings end the text
before their first occurrence; text that could still become the start of a stop string is held back
until it cannot. It knows nothing of the engine or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTEXT = 5  # prompt tokens the first window starts with


class TextStream:
    """The text of one request's generated tokens (see the module docstring)."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token: int) -> bool:
        """Add one generated token; True when a stop string has now appeared (the text ends before it)."""
        if self.stopped:
            return True
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        for stop in self.stops:
            at = self.text.find(stop, start)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """Text not sent yet that can be sent now (all of it when ``final`` or stopped)."""
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
