"""What every HTTP request passes before a route sees it, and the line it leaves in the access log.

:class:`Gate` is a plain ASGI middleware (no body buffering, so streams pass through untouched):
it gives each request an id (the client's ``X-Request-Id`` when it is a sane token, else a new one)
and echoes it as ``X-Request-Id``; with an API key it refuses ``/v1/*`` (and ``/metrics`` when asked)
without ``Authorization: Bearer <key>`` (401, compared in constant time); it refuses a declared body
over the size limit (413) before parsing it, after reading and dropping what the client is already
sending (bounded; :func:`~epikv.serve.limits.drain`), so a client that writes its whole body before it
reads gets the answer instead of a reset connection; and when the response is over it writes one JSON line
to the ``epikv.serve.access`` logger: id, method, path, status, outcome, tokens, cache peak,
evictions, duration. Routes add what only they know to the request's :class:`AccessRecord`.
It knows nothing of the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from epikv.serve.errors import ServeError
from epikv.serve.limits import body_chunks, drain, too_large

ACCESS_LOG = logging.getLogger("epikv.serve.access")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


@dataclass(frozen=True)
class Access:
    """api_key: the key ``/v1/*`` requires (None = open); protect_metrics: ``/metrics`` requires it
    too (default open, as vLLM leaves it: counters only, no request content, and scrapers often lack
    the key). ``/health`` is always open."""

    api_key: str | None = None
    protect_metrics: bool = False

    def __post_init__(self) -> None:
        key = self.api_key
        if key is not None and (not key or any(c.isspace() or not c.isprintable() for c in key)):
            # the key itself is never echoed: it may be a real secret with a typo
            raise ValueError(f"the API key must be printable, without spaces ({len(key)} characters given)")
        if self.protect_metrics and key is None:
            raise ValueError("protect_metrics needs an API key")

    def guards(self, path: str) -> bool:
        if self.api_key is None:
            return False
        return path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")

    def allows(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        expected = (self.api_key or "").encode()
        # compare_digest takes time that depends on the lengths only, never on where bytes differ
        return hmac.compare_digest(token.strip(), expected) and scheme.lower() == b"bearer"


@dataclass
class AccessRecord:
    """One request's access-log line, filled in as it goes."""

    id: str
    method: str
    path: str
    started: float
    status: int | None = None
    outcome: str | None = None
    usage: dict[str, Any] | None = None

    def line(self) -> str:
        fields: dict[str, Any] = {
            "request_id": self.id,
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "outcome": self.outcome,
        }
        for key in ("prompt_tokens", "completion_tokens", "peak_cache_tokens", "evictions"):
            fields[key] = (self.usage or {}).get(key)
        fields["duration_s"] = round(time.perf_counter() - self.started, 4)
        return json.dumps(fields)


def record_of(scope_state: Any) -> AccessRecord | None:
    """The record the gate put in a request's state (None for an app used without the gate)."""
    return getattr(scope_state, "access", None)


class Gate:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app: Any, access: Access, max_body_bytes: int) -> None:
        self.app, self.access, self.max_body_bytes = app, access, max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        record = AccessRecord(rid, scope.get("method", ""), scope.get("path", ""), time.perf_counter())
        scope.setdefault("state", {})["access"] = record

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                tag = (b"x-request-id", rid.encode())
                message = {**message, "headers": [*message.get("headers", []), tag]}
            await send(message)

        try:
            refusal = self.refusal(record.path, headers)
            if refusal is None:
                await self.app(scope, receive, tagged)
            else:
                record.outcome = refusal.code
                if b"100-continue" not in headers.get(b"expect", b"").lower():
                    await drain(body_chunks(receive))  # a client that waits for 100 sends nothing
                response = JSONResponse(refusal.body(), refusal.status, headers=refusal.headers)
                await response(scope, receive, tagged)
        except asyncio.CancelledError:  # the connection went away under the app
            record.outcome = record.outcome or "left"
            raise
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            ACCESS_LOG.info(record.line())

    def refusal(self, path: str, headers: dict[bytes, bytes]) -> ServeError | None:
        if self.access.guards(path) and not self.access.allows(headers.get(b"authorization", b"")):
            error = ServeError(
                "a valid API key is needed: send the header `Authorization: Bearer <key>`",
                status=401,
                code="invalid_api_key",
            )
            error.headers = {"WWW-Authenticate": "Bearer"}
            return error
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return ServeError("the Content-Length header is not a number")
            if int(declared) > self.max_body_bytes:
                return too_large(self.max_body_bytes)
        return None
