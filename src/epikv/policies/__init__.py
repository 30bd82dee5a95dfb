"""Eviction policies: one file each, registered by name (see :mod:`epikv.policies.registry`).

Importing this package imports every policy module, which registers it.
"""

from __future__ import annotations

from epikv.policies import (
    epikv_flat,
    epikv_lag,
    epikv_seg,
    epikv_segq,
    full,
    h2o,
    keydiff,
    lagkv,
    raas,
    random_head,
    random_policy,
    rkv,
    snapkv,
    streaming,
    streaming_prompt,
    thinkv,
    tova,
)
from epikv.policies.base import CacheView, ModelInfo, Needs, Policy, StepSignals
from epikv.policies.registry import ALIASES, get_policy, policy_class, policy_names, register

__all__ = [
    "ALIASES",
    "CacheView",
    "ModelInfo",
    "Needs",
    "Policy",
    "StepSignals",
    "epikv_flat",
    "epikv_lag",
    "epikv_seg",
    "epikv_segq",
    "full",
    "get_policy",
    "h2o",
    "keydiff",
    "lagkv",
    "policy_class",
    "policy_names",
    "raas",
    "random_head",
    "random_policy",
    "register",
    "rkv",
    "snapkv",
    "streaming",
    "streaming_prompt",
    "thinkv",
    "tova",
]
