"""Final-answer extraction from a model completion.

Owns two rules. The paper's: the answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`);
a completion without a box has no answer (None), and neither has one whose last box is cut open
(`... \\boxed{2` at the length cap: the final answer was cut, so an earlier box is not it). And, for
GSM8K only, the "flexible" rule common in GSM8K harnesses (lm-eval's flexible-extract): without a
box, the number after the last `####` or "the answer is", else the last number in the text. Small
models rarely box a GSM8K answer; without this fallback their GSM8K accuracy is 0 whatever the cache
does. The last-number step is not taken for a generation cut at the length cap (issue 58): its last
number is wherever the cap fell, right only by coincidence.
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


def _last_box(text: str) -> tuple[bool, str | None]:
    """Whether the last box command of ``text`` is cut open (no complete argument before the end),
    and that box's stripped content (None when there is no box, or it is cut open or empty)."""
    matches = list(_BOX_COMMAND.finditer(text))
    if not matches:
        return False, None
    content = _box_content(text, matches[-1].end())
    if content is None:
        return True, None
    return False, content.strip() or None


def box_cut_open(text: str) -> bool:
    """Whether the last box command of ``text`` has no complete argument (a final answer cut)."""
    return _last_box(text)[0]


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{}`/`\\fbox{}` in `text`, stripped; None if there is none,
    if it is empty, or if it is cut open (an earlier complete box does not stand in for it)."""
    return _last_box(text)[1]


_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_ANSWER_PHRASE = re.compile(rf"(?:####|answer is:?)\s*\$?\s*({_NUMBER})", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_final_number(text: str, cut: bool = False) -> str | None:
    """GSM8K's flexible answer: the last box's content if there is a box (None when it is cut open),
    else the number after the last ``####`` or "the answer is", else the last number in the text;
    None when the text has no number. ``cut``: the generation stopped at the length cap, so a last
    number that no marker names is not taken for the answer (None)."""
    box_cut, boxed = _last_box(text)
    if box_cut or boxed is not None:
        return boxed
    phrases = _ANSWER_PHRASE.findall(text)
    if phrases:
        return phrases[-1].replace("$", "").rstrip(".")
    numbers = [] if cut else _ANY_NUMBER.findall(text)
    return numbers[-1].replace("$", "").rstrip(".") if numbers else None
