"""Reading the start of a decode's SSE stream.

The proxy holds a stream until its first ``data:`` event so that a decode
which fails before its first token (an error event, an empty stream) can
still be retried: the client has seen nothing yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

_decode_json = msgspec.json.Decoder().decode

DONE = b"[DONE]"


class First(enum.Enum):
    """What a stream began with."""

    DATA = "data"
    ERROR = "error"
    EMPTY = "empty"
    ABORTED = "aborted"


@dataclass(slots=True)
class Verdict:
    kind: First
    message: str = ""


def error_message(data: bytes) -> str | None:
    """The message of an ``{"error": ...}`` event payload; None for other payloads."""
    if b'"error"' not in data:
        return None
    try:
        obj = _decode_json(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    return error_of(obj)


def error_of(obj: object) -> str | None:
    """The message of a parsed ``{"error": ...}`` event; None for other
    events."""
    if not isinstance(obj, dict) or "error" not in obj:
        return None
    err = obj["error"]
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


class FirstEventScanner:
    """Buffers SSE bytes until the first event that carries output.

    A chat stream's opening chunk carries only the assistant's role, and
    comes before the engine's first output, a failed KV load's error event
    included: it is held, not taken for output. A choice finished by
    ``abort`` before any output is :attr:`First.ABORTED`.

    ``feed`` returns None while no complete data event has arrived; then a
    Verdict. ``held`` is every byte fed so far, to relay once the stream is
    accepted.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def held(self) -> bytes:
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> Verdict | None:
        self._buf += chunk
        text = bytes(self._buf)
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = text.split(b"\n\n")
        for event in events[:-1]:  # the last part is incomplete
            data = _event_data(event)
            if data is None:
                continue  # comment, keep-alive or a field without data
            if data.strip() == DONE:
                return Verdict(First.EMPTY, "stream ended before any data")
            message = error_message(data)
            if message is not None:
                return Verdict(First.ERROR, message)
            kind = _output_kind(data)
            if kind is First.ABORTED:
                return Verdict(kind, "decode aborted the request before its output")
            if kind is not None:
                return Verdict(kind)
        return None

    def at_eof(self) -> Verdict:
        """The verdict when the stream ends before ``feed`` gave one."""
        tail = self.feed(b"\n\n") if self._buf else None
        if tail is not None and tail.kind is not First.EMPTY:
            return tail
        return Verdict(First.EMPTY, "stream ended before any data")


def _output_kind(data: bytes) -> First | None:
    """DATA if an event's payload carries output (or is nothing this can
    read), ABORTED if it finishes a choice by ``abort`` before any, None if
    it carries only a chat stream's role."""
    if b'"role"' not in data and b'"abort"' not in data:
        return First.DATA
    try:
        obj = _decode_json(data)
    except (msgspec.DecodeError, RecursionError):
        return First.DATA
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices:
        return First.DATA
    aborted = False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("text"):
            return First.DATA
        delta = choice.get("delta")
        if delta is not None and (
            not isinstance(delta, dict)
            or any(value for key, value in delta.items() if key != "role")
        ):
            return First.DATA
        reason = choice.get("finish_reason")
        if reason == "abort":
            aborted = True
        elif reason is not None or delta is None:
            return First.DATA
    return First.ABORTED if aborted else None


class EventReader:
    """Splits an SSE byte stream into the data payloads of its events."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events ``chunk`` completes (comments skipped)."""
        buf = self._buf + chunk
        held = b""
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # may be half of a CRLF
                buf, held = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events[-1] + held
        return [d for e in events[:-1] if (d := _event_data(e)) is not None]


def _event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` lines of one event, or None if it has none."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # one data line, as vLLM writes every event
    parts: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None
