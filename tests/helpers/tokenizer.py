"""The tests' one toy tokenizer."""

from __future__ import annotations


class CharTokenizer:
    """A tiny character tokenizer (no chat template) so generation tests need no files."""

    pad_token_id = 0
    eos_token_id = 1
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [2 + (ord(c) % 90) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i % 90)) for i in ids if not (skip_special_tokens and i < 2))
