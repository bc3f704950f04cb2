"""The one error every failed Kubernetes API call becomes, with the HTTP status and ``Retry-After`` when there is
one: callers branch on ``status`` (404, 409, 429), never on the exception type."""

from __future__ import annotations


class ApiFailure(Exception):
    def __init__(self, status: int | None, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def one_line(text: str) -> str:
    """A server's or a library's message as one log-friendly line."""
    return " ".join(text.split())
