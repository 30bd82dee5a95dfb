"""The paper's prompt protocol (§1.9): a fixed system message, then the problem as the user turn.

Owns the shape of a chat prompt (`Messages`) and how a problem becomes one.
"""

from __future__ import annotations

Messages = list[dict[str, str]]

PAPER_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def build_messages(problem: str, system_prompt: str | None = PAPER_SYSTEM_PROMPT) -> Messages:
    """Chat messages for one problem; `system_prompt=None` or "" sends the user message only."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": problem})
    return messages
