"""The engine thread: one :class:`~epikv.engine.Engine` stepping in a thread of its own, fed by
commands from the HTTP side and feeding each request's event queue.

HTTP handlers never touch the engine: they ask :meth:`EngineWorker.check` whether a request can
ever run (the engine's gate, which reads only its spec and sizes), send a command (submit, cancel)
through a thread-safe queue and wait on a future or on their request's ``asyncio.Queue``. Between
two engine steps the thread takes every pending command, so a new request joins the running batch at
the next step and a client that went away frees its row at once; a request past its deadline is
finished the same way and told so (408). Events are ``("text", (delta, logprob records))``,
``("done", outcome)`` and ``("error", ServeError)``, delivered on the event loop with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from epikv.engine import Completion, Engine, QueueFull, Request
from epikv.serve.errors import ServeError
from epikv.serve.logprobs import LogprobRecorder, TokenLogprob
from epikv.serve.metrics import ServerMetrics
from epikv.serve.text import TextStream

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One HTTP request's life in the engine thread; ``timeout_s``: its deadline after arrival."""

    request: Request
    text: TextStream
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    recorder: LogprobRecorder | None = None
    timeout_s: float | None = None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None

    def emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class Outcome:
    """What the handler needs once a request is done."""

    text: str
    finish_reason: str
    completion: Completion
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every chosen token's, when asked
    rest: list[TokenLogprob] = field(default_factory=list)  # those no streamed chunk carried yet


class EngineWorker:
    """Runs ``engine`` in a daemon thread until :meth:`stop`."""

    def __init__(self, engine: Engine, tokenizer: Any, metrics: ServerMetrics) -> None:
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.commands: queue.Queue[tuple[str, Any, Future | None]] = queue.Queue()
        self.jobs: dict[int, Job] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epikv-engine", daemon=True)
        self.error: BaseException | None = None
        self.drain_deadline: float | None = None  # set on shutdown: finish by then, or be cancelled

    # -- called from the event loop ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.commands.put(("wake", None, None))
        self._thread.join(timeout)

    def drain(self, seconds: float) -> None:
        """Refuse new requests from now on; requests still running after ``seconds`` are cancelled
        (their streams end with an error chunk), so the server can exit within that time."""
        self.drain_deadline = time.monotonic() + seconds
        self.commands.put(("wake", None, None))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def check(self, request: Request) -> None:
        """Raise the :class:`~epikv.errors.AdmissionError` of a request that can never run here (the
        engine's gate: it reads only the spec and the engine's sizes, so any thread may call it)."""
        self.engine.validate(request)

    def submit(self, job: Job) -> Future:
        """Queue a job for admission; the future fails with ServeError (400/429) if it cannot queue."""
        future: Future = Future()
        self.commands.put(("submit", job, future))
        return future

    def cancel(self, request_id: int) -> None:
        self.commands.put(("cancel", request_id, None))

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with self.engine:
                while not self._stop.is_set():
                    self._drain(block=not self.engine.has_work())
                    if self.engine.has_work():
                        self._step()
                    self._expire()
                    if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                        self._fail_all(_shutting_down())
        except BaseException as err:  # the thread must not die silently
            log.exception("engine thread failed")
            self.error = err
        finally:
            self._fail_all(_shutting_down())

    def _drain(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, value: Any, future: Future | None) -> None:
        if kind == "submit":
            job: Job = value
            if self.drain_deadline is not None:
                future.set_exception(_shutting_down())
                return
            try:
                self.engine.submit(job.request)
            except QueueFull as err:
                self.metrics.rejected.inc()
                future.set_exception(ServeError(f"the server is busy: {err}", status=429, code="queue_full"))
                return
            except ValueError as err:
                future.set_exception(ServeError(str(err)))
                return
            self.jobs[job.request.id] = job
            future.set_result(None)
        elif kind == "cancel":
            job = self.jobs.pop(value, None)
            if job is not None:
                completion = self.engine.finish(value)
                self.metrics.finished("cancelled", completion)
                job.emit("error", ServeError("cancelled", status=499, code="cancelled"))

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            done = self.engine.step()
        except Exception as err:  # a fault in a step fails the running requests, not the server
            log.exception("engine step failed")
            self._fail_all(ServeError(f"internal error: {err}", status=500, code="internal_error"))
            self.engine.clear()
            return
        self.metrics.stepped(self.engine, time.perf_counter() - started)
        for completion in done:
            job = self.jobs.pop(completion.request_id, None)
            if job is None:
                continue
            reason = "stop" if completion.finish_reason in ("eos", "stop") else completion.finish_reason
            self.metrics.finished(reason, completion, job)
            records = job.recorder.tokens if job.recorder else []
            rest = job.recorder.flush() if job.recorder else []
            job.emit("done", Outcome(job.text.text, reason, completion, records, rest))

    def _expire(self) -> None:
        """Finish the requests past their deadline (running or waiting) and tell their clients."""
        now = time.perf_counter()
        late = [j for j in self.jobs.values() if j.timeout_s is not None and now - j.submitted >= j.timeout_s]
        for job in late:
            del self.jobs[job.request.id]
            completion = self.engine.finish(job.request.id, "deadline")
            self.metrics.finished("deadline", completion, job)
            made = len(completion.token_ids) if completion is not None else 0
            message = f"the request ran past its deadline of {job.timeout_s:g} s (--request-timeout)"
            error = ServeError(f"{message} after {made} tokens", status=408, code="request_timeout")
            job.emit("error", error)

    def _fail_all(self, error: ServeError) -> None:
        for request_id, job in list(self.jobs.items()):
            self.engine.finish(request_id)
            job.emit("error", error)
        self.jobs.clear()

    # -- callbacks the engine calls (in this thread) ------------------------------------------------
    def on_token(self, job: Job, token: int) -> bool:
        now = time.perf_counter()
        if job.first_token is None:
            job.first_token = now
            self.metrics.ttft.observe(now - job.submitted)
        else:
            self.metrics.itl.observe(now - job.last_token)
        job.last_token = now
        if job.recorder is not None:
            job.recorder.chosen(token)
        stopped = job.text.push(token)
        delta = job.text.delta()
        if delta:
            job.emit("text", (delta, job.recorder.flush() if job.recorder else []))
        return stopped


def _shutting_down() -> ServeError:
    return ServeError("the server is shutting down", status=503, code="shutting_down")
