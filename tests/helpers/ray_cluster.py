"""A local Ray cluster for one test module: 2 CPUs, no dashboard, torn down at the end, under a time
limit for the whole module, so that a hung cluster fails the run instead of stalling it."""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

T = TypeVar("T", bound=Callable[..., Any])
NO_RAY = importlib.util.find_spec("ray") is None


def ray_test(function: T) -> T:
    """Marks a test that needs a Ray cluster, skipped without Ray; `-m "not slow and not ray"` leaves
    them out."""
    return pytest.mark.ray(pytest.mark.skipif(NO_RAY, reason="Ray is not installed")(function))


@contextmanager
def local_cluster(seconds: int) -> Iterator[Any]:
    """`ray`, initialised on this machine for the block; SIGALRM raises TimeoutError after `seconds`.
    The handler runs once control is back in Python: `run_on_ray` waits in 1 s slices and Serve's
    deploy polls, but a bare `ray.get` without a timeout would not be cut short."""
    import ray

    def expire(*_: Any) -> None:
        raise TimeoutError(f"the Ray tests of this module ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
