"""Final-answer extraction from a model completion.

Owns one rule: the answer is the content of the last complete `\\boxed{...}` (or `\\fbox{...}`).
It does not grade, normalise or guess: a completion without a box has no answer (None), because a
fallback such as "the last number in the text" would credit generations that never committed to one.
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
