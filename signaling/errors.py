"""The one error type handlers raise: it becomes a JSON `{"error": {"code", "message"}}` response."""

from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    """An HTTP error that names the problem; `headers` carries e.g. Retry-After."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message}}, status=status, headers=headers or {}
    )
