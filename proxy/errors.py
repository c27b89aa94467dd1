"""OpenAI-style error bodies, shaped like vLLM's ``ErrorResponse``.

``{"error": {"message", "type", "param", "code"}}`` for JSON replies, and the
same object in one SSE ``data:`` event followed by ``data: [DONE]`` for streams.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

_encode = msgspec.json.Encoder().encode


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The JSON error object for ``status`` with a human-readable ``message``."""
    err_type = _TYPES.get(status)
    if err_type is None:
        try:
            err_type = HTTPStatus(status).phrase.replace(" ", "")
        except ValueError:  # a status a backend made up (520, 599)
            err_type = "ServerError" if status >= 500 else "ClientError"
    return _encode(
        {
            "error": {
                "message": message,
                "type": err_type,
                "param": param,
                "code": status,
            }
        }
    )


def error_response(
    status: int,
    message: str,
    request_id: str | None = None,
    param: str | None = None,
) -> web.Response:
    """A JSON error reply, echoing ``X-Request-Id`` when known."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.Response(
        status=status,
        body=error_body(status, message, param),
        content_type="application/json",
        headers=headers,
    )


def error_event(status: int, message: str) -> bytes:
    """An SSE error event and the closing ``[DONE]``, as vLLM ends a failed stream."""
    return b"data: " + error_body(status, message) + b"\n\ndata: [DONE]\n\n"
