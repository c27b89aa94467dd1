"""A long-running engine holds nothing of its past requests: once they have
finished, however they ended, neither the engine, its checksum scheduler
nor its workers keep any state of them."""

from __future__ import annotations

import asyncio
import contextlib
import random

import aiohttp
import pytest
from fake_engine_helpers import (
    COMPLETIONS,
    completion_body,
    pd,
    post,
    prefill,
    stream,
)

from fake_engine.config import FaultConfig, FaultKind, FaultSide, Role
from fake_engine.engine import Engine
from fake_engine.testing import EngineSpec, fake_engines

ABORT = "/inference/v1/abort_requests"


async def _at_rest(*engines: Engine) -> list[set[str]]:
    """Each engine's held requests once none holds any, or after 10 s (the
    engines finish what clients left in their next steps)."""
    for _ in range(200):
        held = [engine.held_request_ids() for engine in engines]
        if not any(held):
            break
        await asyncio.sleep(0.05)
    return held


async def _leave_mid_stream(
    session: aiohttp.ClientSession, url: str, body: dict
) -> None:
    """Stream a decode, read its first event and go."""
    async with session.post(url + COMPLETIONS, json={**body, "stream": True}) as r:
        assert r.status == 200
        await r.content.readline()


async def test_an_engine_holds_nothing_of_requests_that_ended_in_any_way(
    session: aiohttp.ClientSession,
) -> None:
    specs = (
        EngineSpec(role=Role.PRODUCER, tp_size=2, lease_s=1.0),
        EngineSpec(role=Role.CONSUMER, block_size=32),
    )
    async with fake_engines(*specs) as urls:
        producer, consumer = urls.engine(0), urls.engine(1)
        body = completion_body()

        # Answered, whole and streamed.
        assert (await pd(session, urls[0], urls[1], COMPLETIONS, body))[0] == 200
        params = await prefill(session, urls[0], COMPLETIONS, body)
        streamed = {**body, "stream": True, "kv_transfer_params": params}
        _, events = await stream(session, urls[1] + COMPLETIONS, streamed)
        assert events[-1] == "[DONE]"

        # A corrupted load, failed (fail-closed).
        consumer.configure_faults(
            FaultConfig(FaultKind.BITFLIP, FaultSide.CONSUMER, count=1)
        )
        assert (await pd(session, urls[0], urls[1], COMPLETIONS, body))[0] == 500

        # A hung load whose client gave up.
        consumer.configure_faults(FaultConfig(FaultKind.HANG, FaultSide.CONSUMER))
        params = await prefill(session, urls[0], COMPLETIONS, body)
        with pytest.raises(asyncio.TimeoutError):
            await session.post(
                urls[1] + COMPLETIONS,
                json={**body, "kv_transfer_params": params},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
        consumer.configure_faults(FaultConfig())

        # A decode streamed and left after its first event.
        params = await prefill(session, urls[0], COMPLETIONS, body)
        await _leave_mid_stream(
            session, urls[1], {**body, "kv_transfer_params": params}
        )

        # Prefills never pulled: one aborted, one left to its lease.
        await prefill(session, urls[0], COMPLETIONS, body, request_id="dropped")
        status, _ = await post(session, urls[0] + ABORT, {"request_ids": ["dropped"]})
        assert status == 200
        await prefill(session, urls[0], COMPLETIONS, body)

        assert await _at_rest(producer, consumer) == [set(), set()]
        for engine in (producer, consumer):
            assert engine.kv.pool.num_free == engine.kv.pool.num_usable


async def _any_request(
    session: aiohttp.ClientSession, urls: list[str], rng: random.Random, i: int
) -> None:
    """One request a client might make of a P/D pair, ending one of several
    ways: whole, left mid-stream or after a random wait, a prefill never
    pulled or aborted, a decode without P/D."""
    body = completion_body(prompt=f"p{i} " * rng.randint(1, 40), max_tokens=9)
    ending = rng.choice(["whole", "left", "gave up", "not pulled", "aborted", "local"])
    if ending == "local":
        assert (await post(session, urls[1] + COMPLETIONS, body))[0] == 200
        return
    request_id = f"r{i}"
    params = await prefill(session, urls[0], COMPLETIONS, body, request_id)
    if ending == "not pulled":
        return
    if ending == "aborted":
        await post(session, urls[0] + ABORT, {"request_ids": [request_id]})
        return
    decode = {**body, "kv_transfer_params": params}
    if ending == "whole":
        status, _ = await post(session, urls[1] + COMPLETIONS, decode)
        assert status in (200, 500)  # 500: a corrupted load, failed
    elif ending == "left":
        await _leave_mid_stream(session, urls[1], decode)
    else:
        wait = aiohttp.ClientTimeout(total=rng.random() * 0.2)
        with contextlib.suppress(asyncio.TimeoutError):
            async with session.post(
                urls[1] + COMPLETIONS, json=decode, timeout=wait
            ) as response:
                await response.read()


async def test_engines_short_of_blocks_hold_nothing_after_a_burst_of_any_requests(
    session: aiohttp.ClientSession,
) -> None:
    # Pools of a few requests' blocks: requests wait for blocks and are
    # preempted; one load in five is corrupted.
    specs = (
        EngineSpec(role=Role.PRODUCER, lease_s=1.0, num_blocks=40, max_model_len=512),
        EngineSpec(
            role=Role.CONSUMER,
            block_size=32,
            num_blocks=24,
            max_model_len=512,
            max_num_batched_tokens=256,
            fault=FaultConfig(FaultKind.BITFLIP, FaultSide.CONSUMER, rate=0.2),
        ),
    )
    rng = random.Random(1)
    async with fake_engines(*specs) as urls:
        for wave in range(4):
            await asyncio.gather(
                *(_any_request(session, urls, rng, wave * 20 + i) for i in range(20))
            )
        engines = [urls.engine(0), urls.engine(1)]
        assert await _at_rest(*engines) == [set(), set()]
        for engine in engines:
            assert engine.kv.pool.num_free == engine.kv.pool.num_usable


async def test_engines_without_checksums_hold_nothing_after_their_requests(
    session: aiohttp.ClientSession,
) -> None:
    specs = (
        EngineSpec(role=Role.PRODUCER, lease_s=1.0, kv_checksums=False),
        EngineSpec(role=Role.CONSUMER, kv_checksums=False),
    )
    async with fake_engines(*specs) as urls:
        producer, consumer = urls.engine(0), urls.engine(1)
        body = completion_body()
        assert (await pd(session, urls[0], urls[1], COMPLETIONS, body))[0] == 200
        await prefill(session, urls[0], COMPLETIONS, body)  # never pulled
        assert producer.held_request_ids()  # its KV, for the decode to come
        assert await _at_rest(producer, consumer) == [set(), set()]


async def test_a_load_in_flight_is_held_until_it_ends(
    session: aiohttp.ClientSession,
) -> None:
    specs = (EngineSpec(role=Role.PRODUCER), EngineSpec(role=Role.CONSUMER))
    async with fake_engines(*specs) as urls:
        consumer = urls.engine(1)
        consumer.configure_faults(FaultConfig(FaultKind.HANG, FaultSide.CONSUMER))
        body = completion_body()
        params = await prefill(session, urls[0], COMPLETIONS, body)
        decode = asyncio.ensure_future(
            post(session, urls[1] + COMPLETIONS, {**body, "kv_transfer_params": params})
        )
        for _ in range(200):
            if consumer.held_request_ids():
                break
            await asyncio.sleep(0.01)
        assert len(consumer.held_request_ids()) == 1
        decode.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await decode
        assert await _at_rest(consumer) == [set()]
