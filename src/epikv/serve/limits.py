"""What one request may cost the server: its body, its JSON, its prompt and its time.

:class:`ServeLimits` holds the limits (each an ``epikv serve`` flag); :func:`read_json` reads a body
within the size limit and parses it so that no input can reach a route as a 5xx: bad UTF-8, bad
JSON, integers too long for Python to read, ``NaN`` / ``Infinity``, lone surrogates (which
tokenizers cannot encode) and nesting deeper than the limit are 400s, checked without recursion
(Python's parser raises RecursionError on a deep enough body, which is caught too). It knows
nothing of routes or the engine, and imports no web stack (the command line reads its defaults).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from epikv.serve.errors import ServeError

DRAIN_BYTES = 64 << 20
"""The most of a refused body read and dropped before the answer (see :func:`drain`)."""
DRAIN_SECONDS = 10.0
"""The longest a refused body is read for: a slow sender gets its answer after this, read or not."""


@dataclass(frozen=True)
class ServeLimits:
    """max_body_bytes: largest request body (413 over it); max_json_depth: deepest nesting of arrays
    and objects (400); max_prompt_tokens: longest prompt (400; None = the model's context, which the
    engine enforces anyway); request_timeout_s: seconds from arrival after which a request's row is
    freed and it ends with a 408 (None = no deadline); retry_after_s: the ``Retry-After`` of a 429."""

    max_body_bytes: int = 1 << 20
    max_json_depth: int = 32
    max_prompt_tokens: int | None = None
    request_timeout_s: float | None = 600.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_prompt_tokens", "retry_after_s"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive (or None), got {self.request_timeout_s}")


def limits_from_args(args: Any) -> ServeLimits:
    """The limits of ``epikv serve``'s flags (``--request-timeout 0``: no deadline)."""
    timeout = args.request_timeout or None
    return ServeLimits(
        args.max_body_bytes, args.max_json_depth, args.max_prompt_tokens, timeout, args.retry_after
    )


async def read_json(http: Any, limits: ServeLimits) -> Any:
    """The request's body parsed, or a ServeError: 413 over the size limit (counted as it arrives,
    so a body without a Content-Length is cut off too), 400 for anything :func:`check_json` refuses."""
    size, parts = 0, []
    chunks = http.stream()
    async for chunk in chunks:
        size += len(chunk)
        if size > limits.max_body_bytes:
            await drain(chunks)
            raise too_large(limits.max_body_bytes)
        parts.append(chunk)
    try:
        value = json.loads(b"".join(parts), parse_constant=_no_constant)
    except ValueError as err:  # bad JSON, bad UTF-8, an integer of more than 4,300 digits
        raise ServeError(f"malformed JSON in the request body: {err}") from None
    except RecursionError:
        raise _too_deep(limits.max_json_depth) from None
    check_json(value, limits.max_json_depth)
    return value


async def drain(
    chunks: AsyncIterator[bytes], most: int = DRAIN_BYTES, seconds: float = DRAIN_SECONDS
) -> None:
    """Read and drop the rest of a refused body (up to ``most`` bytes, for at most ``seconds``)
    before the refusal is sent. A client that writes its whole body before it reads (Python's
    ``urllib``, which also asks to close the connection) would otherwise be answered by a socket
    closed with its data unread, which the kernel turns into "connection reset by peer", and never
    read its 413 or 401. Past either bound the answer goes out anyway."""

    async def dropped() -> None:
        seen = 0
        async for chunk in chunks:
            seen += len(chunk)
            if seen > most:
                return

    try:
        await asyncio.wait_for(dropped(), seconds)
    except asyncio.TimeoutError:
        pass


async def body_chunks(receive: Callable[[], Awaitable[dict[str, Any]]]) -> AsyncIterator[bytes]:
    """An ASGI request's body, chunk by chunk, from its ``receive`` (ends on a disconnect)."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


def check_json(value: Any, max_depth: int) -> None:
    """400 unless every array and object is at most ``max_depth`` deep (the top level is depth 1) and
    every string encodes as UTF-8; walked with a stack, never recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ServeError("the request body has a string that is not valid Unicode") from None
            continue
        if isinstance(item, dict):
            children = [*item, *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise _too_deep(max_depth)
        stack.extend((child, depth + 1) for child in children)


def _no_constant(name: str) -> Any:
    raise ServeError(f"{name} is not valid JSON")


def _too_deep(limit: int) -> ServeError:
    return ServeError(f"the request body nests arrays or objects more than {limit} deep (--max-json-depth)")


def too_large(limit: int) -> ServeError:
    return ServeError(
        f"the request body is over {limit} bytes (--max-body-bytes)", status=413, code="request_too_large"
    )
