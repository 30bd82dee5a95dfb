"""epikv: keep a reasoning model's KV cache inside a fixed token budget.

Two lines attach a policy to a Hugging Face causal LM::

    with epikv.attach(model, "epikv", budget=1024) as cache:
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4096)
"""

from importlib import metadata as _metadata

from epikv.cache import BudgetedCache, SequenceStats
from epikv.integration import attach, check_supported, model_info
from epikv.policies import Policy, get_policy, policy_names

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
try:  # one version: the installed package's metadata (pyproject.toml)
    __version__ = _metadata.version("epikv")
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
