"""Tensor parallelism in the worker step, without vLLM: two processes (gloo, localhost) each run the
worker step of ``test_step_faults`` on their own KV head, with real collectives; a fault is injected
on rank 1 only: into one row's scoring, into the batched scoring call only, into one row's move,
into a decode step's observing, into one prefill, and before the first agreement (the store's
write, the decode batch's books: the step's rows fail on both ranks). Both ranks must fault exactly
the same requests, the first rank (whose output the scheduler reads) with rank 1's own line, every
other request must end holding exactly what it holds in the one-process run without the fault, and
no rank may wait alone in a collective (the process group's timeout turns a hang into a failure
here)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epikv.policies.registry import policy_class
from epikv.vllm import step as step_module
from epikv.vllm.compaction import HeadShards, SlotStore
from epikv.vllm.paged import PagedKV
from epikv.vllm.step import EpiKVWorkerState
from tests.plugin_without_vllm.test_step_faults import PROMPTS, held_equal, run

LINE = "a fault for the test"
TIMEOUT_S = 60


def shards(rank: int) -> HeadShards:
    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim)

    def share(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, 0)
        return t

    def union(flags: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def objects(x: Any) -> list[Any]:
        out: list[Any] = [None, None]
        dist.all_gather_object(out, x)
        return out

    return HeadShards(rank, rank + 1, gather, share, union, objects)


def inject(fault: str, policy: str) -> None:
    """Rank 1's fault (see the module docstring); b is the request with prompt length PROMPTS["b"]."""
    b = PROMPTS["b"]
    if fault in ("row", "batched"):
        cls = policy_class(policy)
        score = cls.score

        def broken_score(self, state, view):
            rows = view.prompt_len.tolist()
            if (b in rows) if fault == "row" else len(rows) > 1:
                raise RuntimeError(LINE)
            return score(self, state, view)

        cls.score = broken_score
    elif fault == "move":
        move = PagedKV.move

        def broken_move(self, src, dst, layers, heads):
            if any(32 <= s < 64 for s in src.tolist()):  # b's blocks hold slots 32..63
                raise MemoryError(LINE)
            move(self, src, dst, layers, heads)

        PagedKV.move = broken_move
    elif fault == "write":  # the store's write of a decode step, before any agreement
        write = SlotStore.write

        def broken_write(self, slots, positions):
            if slots.numel() == len(PROMPTS):
                raise RuntimeError(LINE)
            write(self, slots, positions)

        SlotStore.write = broken_write
    elif fault == "books":  # the decode batch's books, read before any agreement

        def broken_snapshot(state):
            raise RuntimeError(LINE)

        step_module.snapshot_rows = broken_snapshot
    elif fault in ("observe", "prefill"):
        name = "_observe" if fault == "observe" else "_prefill"
        method = getattr(EpiKVWorkerState, name)

        def broken(self, *args):
            first = args[0]
            if fault == "observe" or self.requests.records[first].books.prompt_len[0] == b:
                raise RuntimeError(LINE)
            return method(self, *args)

        setattr(EpiKVWorkerState, name, broken)


def rank_main(rank: int, port: int, policy: str, fault: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    try:
        if rank == 1 and fault != "none":
            inject(fault, policy)
        got = run(policy, Path(out) / f"trace{rank}.jsonl", shards=shards(rank))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(got))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(policy: str, fault: str, folder: Path) -> list[dict[str, Any]]:
    folder.mkdir()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(rank_main, args=(free_port(), policy, fault, str(folder)), nprocs=2, join=True)
    return [pickle.loads((folder / f"rank{r}.pkl").read_bytes()) for r in range(2)]


@pytest.fixture(scope="module", params=["streaming", "keydiff"])
def reference(request, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    policy = request.param
    ref = run(policy, tmp_path_factory.mktemp("ref") / "ref.jsonl")
    assert ref["faults"] == {} and all(ref["report"][r][1] > 0 for r in PROMPTS)  # every row evicts
    return policy, ref


def same_as_reference(got: dict[str, Any], ref: dict[str, Any], rank: int, requests: list[str]) -> None:
    """A rank holds the reference's positions and its own head's keys and values, with its counters."""
    for r in requests:
        positions, keys = ref["held"][r]
        assert held_equal(got["held"][r], (positions, [k[rank : rank + 1] for k in keys])), r
        assert got["report"][r] == ref["report"][r], r
        lines = [[x for x in t if x["request"] == r] for t in (got["trace"], ref["trace"])]
        assert lines[0] == lines[1] and lines[0], r


@pytest.mark.parametrize(
    ("fault", "failed", "line"),
    [
        ("row", ["b"], f"compaction failed: RuntimeError: {LINE}"),
        ("move", ["b"], f"compaction failed: MemoryError: {LINE}"),
        ("prefill", ["b"], f"prefill failed: RuntimeError: {LINE}"),
        ("observe", list(PROMPTS), f"decode step failed: RuntimeError: {LINE}"),
        ("write", list(PROMPTS), f"step failed: RuntimeError: {LINE}"),
        ("books", list(PROMPTS), f"step failed: RuntimeError: {LINE}"),
    ],
)
def test_a_fault_on_rank_1_alone_fails_the_same_requests_on_both_ranks(
    reference, tmp_path, fault, failed, line
):
    policy, ref = reference
    ranks = run_tp(policy, fault, tmp_path / "tp")
    for rank, got in enumerate(ranks):
        assert sorted(got["faults"]) == failed, rank
        assert all(why == line for why in got["faults"].values()), (rank, got["faults"])
        same_as_reference(got, ref, rank, [r for r in PROMPTS if r not in failed])


@pytest.mark.parametrize("fault", ["none", "batched"])
def test_no_fault_or_a_fault_of_rank_1s_batched_call_alone_fails_no_request(reference, tmp_path, fault):
    """Without a fault, and with rank 1's batched scoring call failing (each row is then retried
    alone on both ranks), two ranks hold what one process holds."""
    policy, ref = reference
    ranks = run_tp(policy, fault, tmp_path / "tp")
    for rank, got in enumerate(ranks):
        assert got["faults"] == {}
        same_as_reference(got, ref, rank, list(PROMPTS))
