"""Who runs: a FIFO queue, and admission by KV slots reserved from a pool.

The scheduler decides in *cache slots*: a request reserves the most slots it can ever hold
(:class:`epikv.engine.admission.Admission` computes it once, when the request is submitted: K + tau
for an evicting policy, prompt + max_new_tokens for the full cache), waits with it, and keeps it on
its running entry until it leaves. The running entries are the engine's one list of who runs; the
scheduler reads their ``slots`` and keeps no books of its own, so leaving the list is the release.
The pool is physical: the cache's KV arena is a rectangle of rows x slots, as wide as the widest
running request's reservation, so n running requests whose widest reservation is W hold n x W slots,
and admission keeps n x W within the pool P. An evicting policy (every row K + tau) admits
P / (K + tau) requests at once where the full cache admits P / (prompt + max_new_tokens). Requests
wait in order; the head of the queue is never overtaken (no starvation of long requests). Whether a
request could *ever* fit is the gate's question, not this one's. It knows nothing of models or tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from epikv.errors import QueueFull

T = TypeVar("T")


class Reserved(Protocol):
    """A running entry: it carries the cache slots it reserved."""

    @property
    def slots(self) -> int: ...


def footprint(running: Sequence[Reserved]) -> int:
    """Slots the running entries hold in the arena: rows x the widest reservation."""
    return len(running) * max((entry.slots for entry in running), default=0)


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
    """Waiting items, each with the slots it reserves; ``running`` arguments are the running entries."""

    def __init__(self, limits: SchedulerLimits | None = None) -> None:
        self.limits = limits or SchedulerLimits()
        self.waiting: deque[tuple[T, int]] = deque()

    def enqueue(self, item: T, slots: int, running: Sequence[Reserved] = ()) -> None:
        """Queue an item; QueueFull when more than ``max_waiting`` items would have to wait (items
        that will be admitted at the next step do not count)."""
        limit = self.limits.max_waiting
        if limit is not None and self._would_wait(running, [*(s for _, s in self.waiting), slots]) > limit:
            raise QueueFull(f"{limit} requests are already waiting for KV slots (the queue's limit)")
        self.waiting.append((item, slots))

    def can_admit(self, running: Sequence[Reserved], slots: int) -> bool:
        widest = max((entry.slots for entry in running), default=0)
        return self._fits(widest, slots, len(running) + 1)

    def _fits(self, widest: int, slots: int, rows: int) -> bool:
        pool, batch = self.limits.kv_pool, self.limits.max_batch
        return (batch is None or rows <= batch) and (pool is None or rows * max(widest, slots) <= pool)

    def _would_wait(self, running: Sequence[Reserved], queue: list[int]) -> int:
        """How many of ``queue`` (slots, in order) would still wait once the head ones are admitted."""
        widest, rows = max((entry.slots for entry in running), default=0), len(running)
        for index, need in enumerate(queue):
            if not self._fits(widest, need, rows + 1):
                return len(queue) - index  # first come, first served: the rest wait behind it
            widest, rows = max(widest, need), rows + 1
        return 0

    def admissible(self, running: Sequence[Reserved]) -> Iterator[tuple[T, int]]:
        """Pop waiting items in order while the head fits ``running`` (the caller admits each, adding
        it to ``running`` before it asks for the next)."""
        while self.waiting and self.can_admit(running, self.waiting[0][1]):
            yield self.waiting.popleft()

    def remove(self, item: T) -> bool:
        """Drop a waiting item (a client that left before it ran); True if it was waiting."""
        for entry in self.waiting:
            if entry[0] is item:
                self.waiting.remove(entry)
                return True
        return False
