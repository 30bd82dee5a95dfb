"""The one rule that names a model, for per-model profiles and result files.

Owns the identity attribute and how it is read and written. It knows nothing about where a model
came from: the loaders (and the tiny-model factory) call :func:`set_identity`, every reader
(:func:`model_identity`, ``integration.arch.model_info``, the benchmarks) calls
:func:`model_identity`.
"""

from __future__ import annotations

import os
from typing import Any

IDENTITY_ATTRIBUTE = "epikv_model_id"
"""Config attribute naming a model EpiKV named itself. On the config, not the module, so
``save_pretrained`` keeps it and a converted copy loaded with ``from_pretrained`` keeps its name."""


def model_identity(model: Any) -> str:
    """A stable string naming ``model``, used to key per-model profiles.

    In order: the name set by :func:`set_identity` (``"smollm2-135m"`` for the embedded model, whether
    it came from the GGUF or from the cached copy, even when that copy is loaded with ``from_pretrained``
    directly; ``"tiny-llama"`` and ``"random:<preset>"`` for random-weight models); else the name the
    model was loaded under (the hub id, or for a local folder loaded by ``load_model`` its absolute
    path); else ``"<unnamed ClassName>"`` for a model built from a config.
    """
    config = getattr(model, "config", None)
    identity = getattr(config, IDENTITY_ATTRIBUTE, None)
    if isinstance(identity, str) and identity:
        return identity
    for owner in (config, model):
        name = getattr(owner, "name_or_path", None)
        if isinstance(name, (str, os.PathLike)) and str(name):
            return str(name)
    return f"<unnamed {type(model).__name__}>"


def set_identity(model: Any, identity: str) -> None:
    """Name ``model`` for :func:`model_identity`; the name is saved with the config."""
    setattr(model.config, IDENTITY_ATTRIBUTE, identity)
