"""The reference worker the plugin's tests share (``engines.ReferenceWorker``, ``reference.py
serve``): a warm worker answers a job as a process of its own would (nothing of one job stays for the
next), a job's error comes back as a RuntimeError carrying its traceback while the worker goes on, a
killed worker is started again, one that keeps dying fails with its stderr, and a closed one has
left on its own. No vLLM engine starts here."""

from __future__ import annotations

import pytest
import torch

from tests.vllm import engines
from tests.vllm.engines import ReferenceWorker, reference_run


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (9, 17)]


def test_a_failing_job_raises_its_traceback_and_the_worker_goes_on(tiny):
    worker = engines.WORKER
    with pytest.raises(RuntimeError, match=r"(?s)Traceback.*ValueError: unknown policy 'no-such-policy'"):
        reference_run("no-such-policy", 16, _prompts(), 4, model=tiny["llama"])
    pid = worker.proc.pid
    assert len(reference_run("full", None, _prompts(), 4, model=tiny["llama"])["tokens"][1]) == 4
    assert worker.proc.pid == pid


def test_a_warm_worker_answers_as_a_fresh_one_and_a_killed_one_restarts(tiny):
    job = ("streaming", 16, _prompts(), 24)
    first = reference_run(*job, model=tiny["llama"])
    assert all(first["kept"])  # every request evicted: the kept sets say something
    # on the same model object, a policy with hooks on hidden layers and an interval; another model
    reference_run("epikv", 24, _prompts(), 24, model=tiny["llama"], interval=8)
    reference_run("full", None, _prompts(), 24, model=tiny["qwen2"])
    assert reference_run(*job, model=tiny["llama"]) == first
    worker = engines.WORKER
    killed = worker.proc
    killed.kill()
    killed.wait()
    assert reference_run(*job, model=tiny["llama"]) == first  # a fresh process, the model loaded anew
    assert worker.proc.pid != killed.pid
    closing = worker.proc
    worker.close()  # the next job starts one lazily
    assert closing.returncode == 0  # it left when its stdin closed, not killed


def test_a_worker_that_dies_twice_fails_with_its_stderr(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho start >> {tmp_path}/starts\necho "no epikv here: $2" >&2\nexit 3\n')
    fake.chmod(0o755)
    worker = ReferenceWorker(fake)
    with pytest.raises(RuntimeError, match=r"died twice on folder:\nno epikv here: serve"):
        worker.ask({"kind": "folder"})
    worker.close()
    assert (tmp_path / "starts").read_text().split() == ["start", "start"]
