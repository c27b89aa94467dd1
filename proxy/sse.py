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
    accepted. Each byte is scanned once (see :class:`EventReader`).
    """

    __slots__ = ("_events", "_held")

    def __init__(self) -> None:
        self._held = bytearray()
        self._events = EventReader()

    @property
    def held(self) -> bytes:
        return bytes(self._held)

    @property
    def size(self) -> int:
        """Bytes fed so far (``len(held)``, without copying them)."""
        return len(self._held)

    def feed(self, chunk: bytes) -> Verdict | None:
        self._held += chunk
        for data in self._events.feed(chunk):
            verdict = _verdict(data)
            if verdict is not None:
                return verdict
        return None

    def at_eof(self) -> Verdict:
        """The verdict when the stream ends before ``feed`` gave one."""
        tail = self.feed(b"\n\n") if self._held else None
        if tail is not None and tail.kind is not First.EMPTY:
            return tail
        return Verdict(First.EMPTY, "stream ended before any data")


def _verdict(data: bytes) -> Verdict | None:
    """What an event's payload says of the stream: None for a chat stream's
    opening role-only chunk, which says nothing yet."""
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
    """Splits an SSE byte stream into the data payloads of its events.

    Each byte is scanned once, however the stream is cut into reads: an
    event of megabytes (a first chunk with prompt logprobs) that arrives in
    many reads costs no more than in one, and never blocks the event loop
    for longer.
    """

    __slots__ = ("_buf", "_cr", "_scanned")

    def __init__(self) -> None:
        # The incomplete event, its line endings made \n.
        self._buf = bytearray()
        # The last read ended with \r: maybe the first half of a CRLF.
        self._cr = False
        # How much of _buf holds no blank line.
        self._scanned = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events ``chunk`` completes (comments skipped)."""
        if self._cr:
            chunk, self._cr = b"\r" + chunk, False
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                chunk, self._cr = chunk[:-1], True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf
        if buf:
            buf += chunk
            # A blank line may begin in the last byte already scanned.
            if buf.find(b"\n\n", max(self._scanned - 1, 0)) == -1:
                self._scanned = len(buf)
                return []
            chunk = bytes(buf)
            buf.clear()
        events = chunk.split(b"\n\n")
        rest = events.pop()
        if rest:
            buf += rest
        self._scanned = len(rest)
        return [d for e in events if (d := _event_data(e)) is not None]


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
