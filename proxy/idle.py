"""An idle timeout that costs a float store per read, not a timer per read.

``asyncio.timeout`` rescheduled after every read of a stream cancels one
timer and starts another per chunk: one per token of every stream. Here a
read only notes the time (``touch``); one timer, when it fires, re-arms
itself for the last read plus the idle limit while the stream has kept
moving, and expires the timeout only once it has not: at the moment a timer
moved on every read would have.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class IdleTimeout:
    """``async with``: raises TimeoutError ``idle`` seconds after the last
    ``touch`` (or after entering), or at ``deadline``, whichever is first.

    ``deadline`` is in the running loop's ``time()``. Built on
    ``asyncio.timeout`` (its cancellation and TimeoutError), which it
    expires itself.
    """

    def __init__(self, idle: float, deadline: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = idle
        self._deadline = deadline
        self._last = self._loop.time()
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> IdleTimeout:
        await self._timeout.__aenter__()
        self._handle = self._loop.call_at(self._due(), self._check)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        await self._timeout.__aexit__(exc_type, exc, tb)

    def touch(self) -> None:
        """Notes that data arrived now: the idle period starts again."""
        self._last = self._loop.time()

    def _due(self) -> float:
        return min(self._last + self._idle, self._deadline)

    def _check(self) -> None:
        due = self._due()
        now = self._loop.time()
        if due > now:  # data arrived since the timer was set
            self._handle = self._loop.call_at(due, self._check)
        else:
            self._handle = None
            self._timeout.reschedule(now)  # expires it: the task is cancelled
