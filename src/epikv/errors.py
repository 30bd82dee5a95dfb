"""How a command's failure reaches its user: one line and an exit status, never a traceback.

Owns the exit statuses of ``epikv`` (2: a mistake the user can fix; 130: interrupted by Ctrl-C;
141: the reader of standard output went away, as ``epikv policies --json | head`` does) and the rule
for which exceptions are the user's to fix: ``ValueError`` (a bad value, a prompt that cannot fit),
``OSError`` (paths and permissions, a model that cannot be found or downloaded, a run folder another
process is writing) and ``ImportError`` (a missing optional package). Anything else is a bug and
keeps its traceback. ``--verbose`` keeps the traceback of user errors too.

A command that is interrupted says what it kept by raising :class:`Interrupted` with that summary.

It also holds the one family of admission errors (:class:`AdmissionError`): what the engine's gate
(:mod:`epikv.engine.admission`) and the spec's budget rules raise for a request that can never run,
each naming the request field to blame, and :class:`QueueFull` for one that cannot wait now.
It knows no command and imports nothing of epikv, so the spec and the engine can both raise them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command killed by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as `yes | head` reports its writer
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError)


class AdmissionError(ValueError):
    """A request that can never run on this engine, however long it waited. ``field`` names the
    request's field to blame (``budget``, ``prompt``, ``max_new_tokens``), so a server maps each to
    its own parameter without asking which class it is."""

    field = "prompt"


class BudgetOutOfRange(AdmissionError):
    """A request's own budget outside 1..the engine's K (or set at all for a spec that keeps all)."""

    field = "budget"


class PromptTooLong(AdmissionError):
    """A prompt longer than the model's context: no budget helps."""


class BudgetTooSmall(AdmissionError):
    """A budget cannot hold a prompt's protected tokens; ``min_budget`` is the smallest that can."""

    def __init__(self, message: str, min_budget: int) -> None:
        super().__init__(message)
        self.min_budget = min_budget


class PoolTooSmall(AdmissionError):
    """A request needs more cache slots than the whole KV pool holds: no wait would admit it."""

    field = "max_new_tokens"


class QueueFull(RuntimeError):
    """The waiting queue is at its limit: not a mistake in the request, so not a ValueError (a server
    answers 429 and the client retries)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying a one-line summary of what the command kept (e.g. results on disk)."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (library messages, e.g. transformers', span several)."""
    return " ".join(str(error).split()) or type(error).__name__


def run_command(command: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Runs ``command(args)`` and turns how it ended into an exit status, printing at most one line."""
    try:
        status = int(command(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here when the output was small
        return status
    except KeyboardInterrupt as interrupt:
        kept = one_line(interrupt) if str(interrupt) else ""
        print(f"epikv: interrupted{': ' + kept if kept else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _detach_stdout()
        return EXIT_BROKEN_PIPE
    except USER_ERRORS as error:
        if getattr(args, "verbose", False):
            raise
        print(f"epikv: error: {one_line(error)}", file=sys.stderr)
        return EXIT_USAGE


def _detach_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's last flush of a closed pipe stays silent
    (the recipe of the Python docs' note on SIGPIPE)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test's capture): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)
