"""Reaching a Ray cluster: the optional import with its install hint, and joining or starting one.

Ray is an optional extra (`pip install 'epikv[ray]'`). This module owns only the connection;
`epikv.eval.ray_runner` (shards as Ray tasks) and `epikv.serve.ray_serve` (Serve replicas) use it.
It knows nothing about evaluation or serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

INSTALL_HINT = "Ray is not installed; install it with: pip install 'epikv[ray]'"


def import_ray() -> Any:
    """The `ray` module, or an ImportError whose one-line message says how to install it."""
    try:
        import ray
    except ModuleNotFoundError as err:
        raise ImportError(INSTALL_HINT) from err
    return ray


def import_serve() -> Any:
    """`ray.serve`, which needs Ray's own `serve` extra (included in `epikv[ray]`)."""
    import_ray()
    try:
        from ray import serve
    except ImportError as err:
        hint = "install it with: pip install 'epikv[ray]'"
        raise ImportError(f"Ray Serve cannot be imported ({err}); {hint}") from err
    return serve


def gpus_or_default(ray: Any, gpus: float | None) -> float:
    """`gpus`, or when None one GPU if the cluster has any and none otherwise: on a GPU cluster a task
    or replica that reserves no GPU is hidden from them (Ray sets CUDA_VISIBLE_DEVICES) and runs on CPU."""
    if gpus is not None:
        return gpus
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0


@contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """Ray, initialised for the block. A session this process already opened is reused and left
    open. Otherwise `ray.init(address)`: an address (`auto`, `HOST:PORT`, `ray://HOST:10001`) joins
    that cluster; None follows Ray's own rule (the cluster in `RAY_ADDRESS` or one `ray start`ed on
    this machine, else a new local instance). A session opened here is closed on exit, which also
    stops a local instance started here."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    ray.init(address=address or None)
    try:
        yield ray
    finally:
        ray.shutdown()
