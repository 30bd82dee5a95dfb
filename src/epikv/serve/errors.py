"""The server's one error type: an HTTP status and the OpenAI error body. No dependencies, so the
command line can name limits without importing the web stack."""

from __future__ import annotations

from typing import Any


class ServeError(Exception):
    """An error with its HTTP status and OpenAI error body."""

    def __init__(
        self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.headers: dict[str, str] = {}
        # OpenAI's types: a 401 for a bad key is an invalid_request_error too
        kinds = {429: "rate_limit_error"}
        self.type = kinds.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}
