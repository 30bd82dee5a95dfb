"""Policy registry: every policy registers itself by name; lookups suggest close names on a typo.

Policy modules import :func:`register` from here, never from the package ``epikv.policies`` (which
imports them), so no import runs back up the folder.
"""

from __future__ import annotations

import difflib
from typing import Any

from epikv.policies.base import Policy

_REGISTRY: dict[str, type[Policy]] = {}
ALIASES = {"epikv": "epikv-segq"}  # the default EpiKV is the latest published form (v3)


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator adding a policy under ``cls.name``; a clash is an error."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} already registered by {_REGISTRY[cls.name].__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[Policy]:
    name = ALIASES.get(name, name)
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, [*_REGISTRY, *ALIASES], n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown policy {name!r}{hint} (known: {', '.join(policy_names())})")
    return _REGISTRY[name]


def get_policy(name: str | Policy, **params: Any) -> Policy:
    """A policy instance by registered name (or an instance passed through), with parameters overridden."""
    if isinstance(name, Policy):
        return name.with_params(**params) if params else name
    return policy_class(name)().with_params(**params)
