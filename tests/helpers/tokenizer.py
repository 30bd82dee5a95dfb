"""The tests' one toy tokenizer."""

from __future__ import annotations


class CharTokenizer:
    """A character tokenizer (no chat template) so generation tests need no files. By default each
    character is folded into ids 2..91 for tiny vocabularies; ``fold=None`` keeps its code point, so
    :meth:`decode` gives the text back exactly."""

    pad_token_id = 0
    eos_token_id = 1
    chat_template: str | None = None

    def __init__(self, fold: int | None = 90) -> None:
        self.fold = fold

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if self.fold is None:
            return {"input_ids": [ord(c) for c in text]}
        return {"input_ids": [2 + (ord(c) % self.fold) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.fold is None:
            return "".join(chr(i) for i in ids)
        return "".join(chr(32 + (i % self.fold)) for i in ids if not (skip_special_tokens and i < 2))


class ChatCharTokenizer(CharTokenizer):
    """:class:`CharTokenizer` with a chat template of role tags: ``<role>content`` per message."""

    chat_template = "role tags"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
