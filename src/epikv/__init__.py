"""epikv: keep a reasoning model's KV cache inside a fixed token budget.

Two lines attach a policy to a Hugging Face causal LM::

    with epikv.attach(model, "epikv", budget=1024) as cache:
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)

The names below are imported when first used, so the core (``epikv.policies``, ``epikv.selection``,
``epikv.scoring``, ``epikv.spec``) imports without the transformers-specific layers: that is what
the vLLM plugin (``epikv.vllm``) runs on inside vLLM's own environment.
"""

from __future__ import annotations

from importlib import import_module
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epikv.cache import BudgetedCache, SequenceStats
    from epikv.integration import attach, check_supported, model_info
    from epikv.policies import Policy, get_policy, policy_names

_LAZY = {
    "BudgetedCache": "epikv.cache",
    "SequenceStats": "epikv.cache",
    "attach": "epikv.integration",
    "check_supported": "epikv.integration",
    "model_info": "epikv.integration",
    "Policy": "epikv.policies",
    "get_policy": "epikv.policies",
    "policy_names": "epikv.policies",
}

__all__ = [
    "BudgetedCache",
    "Policy",
    "SequenceStats",
    "attach",
    "check_supported",
    "get_policy",
    "model_info",
    "policy_names",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epikv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


try:  # one version: the installed package's metadata (pyproject.toml)
    __version__ = _metadata.version("epikv")
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
