"""The scheduler's books: slots reserved never exceed the pool, first come first served, a bounded queue."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from epikv.engine import QueueFull, Scheduler, SchedulerLimits
from epikv.engine.scheduler import footprint


@dataclass
class Running:
    """A running entry, carrying its reservation (as the engine's rows do)."""

    item: str
    slots: int


def admit_all(scheduler: Scheduler, running: list[Running]) -> list[str]:
    out = []
    for item, slots in scheduler.admissible(running):
        running.append(Running(item, slots))
        out.append(item)
    return out


def test_pool_and_first_come_first_served():
    s: Scheduler[str] = Scheduler(SchedulerLimits(kv_pool=100))
    running: list[Running] = []
    for name, slots in (("a", 60), ("b", 50), ("c", 10)):
        s.enqueue(name, slots, running)
    assert admit_all(s, running) == ["a"]  # b does not fit, and c may not overtake it
    assert footprint(running) == 60 and [i for i, _ in s.waiting] == ["b", "c"]
    running.clear()  # a leaves: leaving the running list is the release
    # The arena is a rectangle: two rows as wide as the widest reservation (50) hold 100 slots.
    assert admit_all(s, running) == ["b", "c"] and footprint(running) == 100


def test_batch_limit():
    s: Scheduler[str] = Scheduler(SchedulerLimits(max_batch=2))
    for name in "abc":
        s.enqueue(name, 1000)
    assert admit_all(s, []) == ["a", "b"]


def test_queue_counts_only_what_must_wait():
    s: Scheduler[str] = Scheduler(SchedulerLimits(kv_pool=100, max_waiting=1))
    s.enqueue("a", 50)
    s.enqueue("b", 50)  # both fit the pool: neither waits
    s.enqueue("c", 50)  # waits
    with pytest.raises(QueueFull, match="1 requests are already waiting"):
        s.enqueue("d", 10)
    assert admit_all(s, []) == ["a", "b"]


def test_remove_a_waiting_item():
    s: Scheduler[str] = Scheduler(SchedulerLimits(kv_pool=10))
    s.enqueue("a", 10)
    s.enqueue("b", 10)
    assert s.remove("b") and not s.remove("b")
    assert admit_all(s, []) == ["a"] and not s.waiting


def test_limits_are_checked():
    with pytest.raises(ValueError, match="kv_pool"):
        SchedulerLimits(kv_pool=0)
