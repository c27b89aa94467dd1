"""IdleTimeout: the collected stream's idle limit, one timer per stream
rather than one per chunk, firing when a timer moved on every chunk would."""

from __future__ import annotations

import asyncio

import pytest

from proxy.idle import IdleTimeout

IDLE = 0.2
# Upper bounds leave a loaded machine room; lower bounds are exact.
SLACK = 1.0


async def test_it_fires_idle_seconds_after_entering_without_data() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with IdleTimeout(IDLE, start + 60):
            await asyncio.sleep(60)
    assert IDLE <= loop.time() - start < IDLE + SLACK


async def test_data_keeps_it_alive_and_it_fires_idle_seconds_after_the_last() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    last = start
    with pytest.raises(TimeoutError):
        async with IdleTimeout(IDLE, start + 60) as timer:
            for _ in range(6):
                await asyncio.sleep(IDLE / 2)
                timer.touch()
                last = loop.time()
            await asyncio.sleep(60)
    assert last - start >= 3 * IDLE
    assert IDLE <= loop.time() - last < IDLE + SLACK


async def test_the_deadline_ends_it_while_data_still_comes() -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TimeoutError):
        async with IdleTimeout(60, start + IDLE) as timer:
            while True:
                await asyncio.sleep(0.01)
                timer.touch()
    assert IDLE <= loop.time() - start < IDLE + SLACK


async def test_leaving_in_time_cancels_nothing_later() -> None:
    async with IdleTimeout(IDLE, asyncio.get_running_loop().time() + 60) as timer:
        timer.touch()
    # Its timer is gone: sleeping past it is not cancelled.
    await asyncio.sleep(IDLE * 2)


async def test_an_error_inside_passes_through_unchanged() -> None:
    with pytest.raises(ValueError, match="boom"):
        async with IdleTimeout(IDLE, asyncio.get_running_loop().time() + 60):
            raise ValueError("boom")
