"""KVGuard's reason in the error a client gets for a load it failed.

vLLM 0.32 answers every request that finished with an error, a failed KV
load included, with the same "Internal server error" (HTTP 500, or an error
event in a stream). KVGuard's scheduler sends the engine ids of the loads it
failed, with their messages, in its connector stats; the API server's stats
loggers record them here (before the failed request's output is processed,
in the same output-handler pass), and :func:`kv_checksum_errors`, an HTTP
middleware loaded with ``--middleware engine_patch.vllm.errors.kv_checksum_errors``,
puts the message into that request's error: "KV checksum mismatch: ...",
which the KVGuard proxy matches to retry the request on another prefill.

A request is matched by its ``X-Request-Id`` header (vLLM builds its engine
ids from it); without one its error stays generic.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

# vLLM's message for a request that finished with an error.
GENERIC_ERROR = "Internal server error"
_GENERIC_BYTES = json.dumps(GENERIC_ERROR).encode()

# vLLM's engine request ids: the client's id, a prompt index (completions)
# and 8 random hex digits.
_ENGINE_IDS = (
    re.compile(r"cmpl-(?P<client>.+)-\d+-[0-9a-f]{8}"),
    re.compile(r"chatcmpl-(?P<client>.+)-[0-9a-f]{8}"),
)

# Failed loads kept for matching: the newest, for a while.
_MAX_FAILURES = 4096
_TTL_S = 300.0

_lock = threading.Lock()
# Client request id -> (message, time recorded).
_failures: OrderedDict[str, tuple[str, float]] = OrderedDict()


def client_request_id(engine_request_id: str) -> str | None:
    """The ``X-Request-Id`` vLLM built an engine request id from
    (``cmpl-{id}-{prompt}-{random}``, ``chatcmpl-{id}-{random}``), if it is
    one of those."""
    for pattern in _ENGINE_IDS:
        if (match := pattern.fullmatch(engine_request_id)) is not None:
            return match["client"]
    return None


def record_failures(failures: Mapping[str, str]) -> None:
    """Remember the messages of loads KVGuard failed, by engine request id."""
    if not failures:
        return
    now = time.monotonic()
    with _lock:
        for req_id, message in failures.items():
            client = client_request_id(req_id)
            if client is None:
                continue
            _failures[client] = (message, now)
            _failures.move_to_end(client)
        while len(_failures) > _MAX_FAILURES:
            _failures.popitem(last=False)


def failure_for(request_id: str) -> str | None:
    """The message of a failed load of the client request ``request_id`` (its
    ``X-Request-Id``), if KVGuard failed one recently."""
    with _lock:
        found = _failures.get(request_id)
    if found is None or time.monotonic() - found[1] > _TTL_S:
        return None
    return found[0]


def rewrite(body: bytes, message: str) -> bytes:
    """``body`` (a JSON error, or SSE events) with vLLM's generic error
    message replaced by ``message``."""
    return body.replace(_GENERIC_BYTES, json.dumps(message).encode())


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class KVChecksumErrorMiddleware:
    """ASGI middleware: a request's generic engine error carries KVGuard's
    message instead, when KVGuard failed its KV load.

    A sized response (a JSON error) is buffered only if its status is 500;
    a streamed one (SSE, no length) has its chunks rewritten as they pass.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = None
        if scope["type"] == "http":
            request_id = next(
                (
                    value.decode("latin-1")
                    for name, value in scope.get("headers", ())
                    if name.lower() == b"x-request-id"
                ),
                None,
            )
        if not request_id:
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _Rewriter(request_id, send))


class _Rewriter:
    """The ``send`` of one request, rewriting its generic error."""

    def __init__(self, request_id: str, send: Send) -> None:
        self._request_id = request_id
        self._send = send
        self._start: Message | None = None  # Held while a 500 is buffered.
        self._buffer: list[bytes] = []
        self._streamed = False

    def _rewrite(self, body: bytes) -> bytes:
        if _GENERIC_BYTES not in body:
            return body
        message = failure_for(self._request_id)
        return body if message is None else rewrite(body, message)

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", ())
            sized = any(name.lower() == b"content-length" for name, _ in headers)
            if message.get("status") == 500 and sized:
                self._start = message
                return
            self._streamed = not sized
            await self._send(message)
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        if self._start is not None:
            self._buffer.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = self._rewrite(b"".join(self._buffer))
            headers = [
                (name, value)
                for name, value in self._start.get("headers", ())
                if name.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await self._send({**self._start, "headers": headers})
            self._start = None
            await self._send({"type": "http.response.body", "body": body})
            return
        if self._streamed and (body := message.get("body", b"")):
            message = {**message, "body": self._rewrite(body)}
        await self._send(message)


# The name to pass to ``--middleware``.
kv_checksum_errors = KVChecksumErrorMiddleware
