"""EpiKV's cache folder, host-neutral (no transformers, no model code): converted models, user band
profiles and peer environments live under it, and the vLLM plugin reads profiles from it without
loading :mod:`epikv.models`."""

from __future__ import annotations

import os
from pathlib import Path


def model_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """EpiKV's cache folder (not created here).

    Order: ``cache_dir`` if given, else ``$EPIKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/epikv``, else
    ``~/.cache/epikv``. Converted models live in its ``models/`` subfolder.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get("EPIKV_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "epikv"
