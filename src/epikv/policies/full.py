"""``full``: never evicts; the plain-cache reference every other policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass

from epikv.policies.base import Policy
from epikv.policies.registry import register


@register
@dataclass(frozen=True)
class Full(Policy):
    """Keep every token (no budget)."""

    name = "full"
    summary = "No eviction: a plain growing cache."
    source = ""
    evicts = False
