"""Who runs: a FIFO queue, and admission by KV slots reserved from a pool.

The scheduler keeps the books of one engine's memory in *cache slots*: a request reserves the most
slots it can ever hold (:meth:`epikv.spec.CacheSpec.peak_tokens`: K + tau for an evicting policy,
prompt + max_new_tokens for the full cache) when it is admitted and returns them when it leaves.
The pool is physical: the cache's KV arena is a rectangle of rows x slots, as wide as the widest
running request's reservation, so n running requests whose widest reservation is W hold n x W slots,
and admission keeps n x W within the pool P. An evicting policy (every row K + tau) admits
P / (K + tau) requests at once where the full cache admits P / (prompt + max_new_tokens). Requests
wait in order; the head of the queue is never overtaken (no starvation of long requests). It knows
nothing of models or tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFull(RuntimeError):
    """The waiting queue is at its limit (a server answers 429)."""


class PoolTooSmall(ValueError):
    """A request needs more cache slots than the whole KV pool holds: no wait would admit it."""


@dataclass(frozen=True)
class SchedulerLimits:
    """kv_pool: slots all running requests may reserve together (None = unlimited); max_batch: rows
    decoded together (None = unlimited); max_waiting: requests that may wait (None = unlimited)."""

    kv_pool: int | None = None
    max_batch: int | None = None
    max_waiting: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_pool", "max_batch", "max_waiting"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "max_waiting" else 1):
                raise ValueError(f"{name} must be a positive number, got {value}")


class Scheduler(Generic[T]):
    """Waiting items (each with the slots it needs) and the slots reserved by running ones."""

    def __init__(self, limits: SchedulerLimits | None = None) -> None:
        self.limits = limits or SchedulerLimits()
        self.waiting: deque[tuple[T, int]] = deque()
        self.reserved: dict[int, int] = {}

    @property
    def reserved_slots(self) -> int:
        """Slots the running requests hold in the arena: rows x the widest reservation."""
        return len(self.reserved) * max(self.reserved.values(), default=0)

    def check(self, slots: int) -> None:
        """Refuse at once what no amount of waiting would admit."""
        pool = self.limits.kv_pool
        if pool is not None and slots > pool:
            raise PoolTooSmall(f"the request needs {slots} cache slots but the whole KV pool holds {pool}")

    def enqueue(self, item: T, slots: int) -> None:
        """Queue an item; QueueFull when more than ``max_waiting`` items would have to wait (items
        that will be admitted at the next step do not count)."""
        self.check(slots)
        limit = self.limits.max_waiting
        if limit is not None and self._would_wait([*(s for _, s in self.waiting), slots]) > limit:
            raise QueueFull(f"{limit} requests are already waiting for KV slots (the queue's limit)")
        self.waiting.append((item, slots))

    def can_admit(self, slots: int) -> bool:
        return self._fits(max(self.reserved.values(), default=0), slots, len(self.reserved) + 1)

    def _fits(self, widest: int, slots: int, rows: int) -> bool:
        pool, batch = self.limits.kv_pool, self.limits.max_batch
        return (batch is None or rows <= batch) and (pool is None or rows * max(widest, slots) <= pool)

    def _would_wait(self, queue: list[int]) -> int:
        """How many of ``queue`` (slots, in order) would still wait once the head ones are admitted."""
        widest, rows = max(self.reserved.values(), default=0), len(self.reserved)
        for index, need in enumerate(queue):
            if not self._fits(widest, need, rows + 1):
                return len(queue) - index  # first come, first served: the rest wait behind it
            widest, rows = max(widest, need), rows + 1
        return 0

    def admit(self, key: int, slots: int) -> None:
        if not self.can_admit(slots):
            raise RuntimeError(f"admitting {slots} slots would exceed the pool or the batch limit")
        self.reserved[key] = slots

    def release(self, key: int) -> None:
        self.reserved.pop(key, None)

    def admissible(self) -> Iterator[tuple[T, int]]:
        """Pop waiting items in order while the head fits (the caller then admits each)."""
        while self.waiting and self.can_admit(self.waiting[0][1]):
            yield self.waiting.popleft()

    def remove(self, item: T) -> bool:
        """Drop a waiting item (a client that left before it ran); True if it was waiting."""
        for entry in self.waiting:
            if entry[0] is item:
                self.waiting.remove(entry)
                return True
        return False
