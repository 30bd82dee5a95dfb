"""Final-answer extraction from a model completion.

Owns two rules. The paper's: the answer is the content of the last complete `\\boxed{...}` (or
`\\fbox{...}`); a completion without a box has no answer (None). And, for GSM8K only, the
"flexible" rule common in GSM8K harnesses (lm-eval's flexible-extract): without a box, the number
after the last `####` or "the answer is", else the last number in the text. Small models rarely box
a GSM8K answer; without this fallback their GSM8K accuracy is 0 whatever the cache does.
"""

from __future__ import annotations

import re

# `\boxed` or `\fbox` not followed by another letter (so `\boxedx` is not a box).
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Brace-less form: `\boxed 5` takes the next whitespace-delimited token, stopping at `$`.
_BARE_ARGUMENT = re.compile(r"\s+([^\s$]+)")


def _braced_argument(text: str, open_at: int) -> str | None:
    """Returns the text inside the brace group opening at `text[open_at]`, or None if unclosed.

    Escaped braces (`\\{`, `\\}`) do not count, so set answers like `\\{1, 2\\}` survive.
    """
    depth = 0
    i = open_at
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


def _box_content(text: str, end_of_command: int) -> str | None:
    """The argument of the box command ending at `end_of_command`, or None if there is none."""
    rest = text[end_of_command:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _braced_argument(text, end_of_command + len(rest) - len(stripped))
    bare = _BARE_ARGUMENT.match(rest)
    return bare.group(1) if bare else None


def extract_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{}`/`\\fbox{}` in `text`, stripped; None if none.

    An unclosed box (a generation cut at the length cap mid-answer) is skipped, so the previous
    complete box counts. An empty box counts as no answer.
    """
    for match in reversed(list(_BOX_COMMAND.finditer(text))):
        content = _box_content(text, match.end())
        if content is not None:
            content = content.strip()
            return content or None
    return None


_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_ANSWER_PHRASE = re.compile(rf"(?:####|answer is:?)\s*\$?\s*({_NUMBER})", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_final_number(text: str) -> str | None:
    """GSM8K's flexible answer: the boxed answer if any, else the number after the last ``####`` or
    "the answer is", else the last number in the text; None when the text has no number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    phrases = _ANSWER_PHRASE.findall(text)
    if phrases:
        return phrases[-1].replace("$", "").rstrip(".")
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1].replace("$", "").rstrip(".") if numbers else None
