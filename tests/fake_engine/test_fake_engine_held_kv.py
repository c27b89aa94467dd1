"""A prefill holds its KV blocks for the decode until they are pulled, the
request is aborted (by the caller's id or the prefill's own), or the lease
ends — read from /metrics — and a stopped engine lets the others go on."""

from __future__ import annotations

import asyncio
import logging
from unittest import mock

import aiohttp
import pytest
from aiohttp import ClientConnectionResetError, StreamReader
from aiohttp.test_utils import make_mocked_request
from fake_engine_helpers import (
    COMPLETIONS,
    completion_body,
    metric,
    post,
    post_bytes,
    prefill,
)

from fake_engine.config import Role
from fake_engine.request import RemoteSource
from fake_engine.testing import EngineSpec, fake_engines
from fake_engine.transfer import PULL_PATH, PullRequest, encode_pull_request

HELD = "kvguard_kv_blocks_held"
ABORT = "/inference/v1/abort_requests"


async def test_held_blocks_drop_to_zero_after_the_pull(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(
        EngineSpec(role=Role.PRODUCER), EngineSpec(role=Role.CONSUMER)
    ) as urls:
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        assert await metric(session, urls[0], HELD) == 5
        status, _ = await post(
            session,
            urls[1] + COMPLETIONS,
            {**completion_body(), "kv_transfer_params": params},
        )
        assert status == 200
        assert await metric(session, urls[0], HELD) == 0
        # A second pull of the same KV finds nothing: the load fails.
        status, answer = await post(
            session,
            urls[1] + COMPLETIONS,
            {**completion_body(), "kv_transfer_params": params},
        )
        assert status == 500 and "404" in answer["error"]["message"]


async def test_a_producer_refuses_pulls_it_cannot_serve_and_keeps_the_kv(
    session: aiohttp.ClientSession,
) -> None:
    # A lease of 10 s: expiry runs every second, so the KV must still be
    # held after one tick, not released at it.
    async with fake_engines(EngineSpec(role=Role.PRODUCER, lease_s=10.0)) as urls:
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        source = RemoteSource.from_params(params)
        assert source is not None
        held = await metric(session, urls[0], HELD)
        (blocks,) = source.block_ids
        refused = {
            409: PullRequest("another-engine", source.request_id, [blocks]),
            404: PullRequest(source.engine_id, "no-such-request", [blocks]),
            400: PullRequest(source.engine_id, source.request_id, [[max(blocks) + 1]]),
        }
        two_groups = PullRequest(source.engine_id, source.request_id, [blocks, blocks])
        for status, pull in [*refused.items(), (400, two_groups)]:
            answer = await post_bytes(
                session, urls[0] + PULL_PATH, encode_pull_request(pull)
            )
            assert answer[0] == status, (pull, answer)
        await asyncio.sleep(1.2)
        assert await metric(session, urls[0], HELD) == held
        pull = PullRequest(source.engine_id, source.request_id, [blocks])
        async with session.post(
            urls[0] + PULL_PATH, data=encode_pull_request(pull)
        ) as response:
            assert response.status == 200
            assert len(await response.read()) > 0
        assert await metric(session, urls[0], HELD) == 0


@pytest.mark.parametrize("by", ["caller-id", "remote-request-id"])
async def test_held_blocks_drop_to_zero_after_abort(
    session: aiohttp.ClientSession, by: str
) -> None:
    async with fake_engines(EngineSpec(role=Role.PRODUCER)) as urls:
        params = await prefill(
            session, urls[0], COMPLETIONS, completion_body(), "job-1"
        )
        assert await metric(session, urls[0], HELD) == 5
        request_id = "job-1" if by == "caller-id" else params["remote_request_id"]
        status, _ = await post(session, urls[0] + ABORT, {"request_ids": [request_id]})
        assert status == 200
        assert await metric(session, urls[0], HELD) == 0
        assert await metric(session, urls[0], "kvguard_requests_aborted_total") == 1


async def test_held_blocks_drop_to_zero_when_the_lease_ends(
    session: aiohttp.ClientSession,
) -> None:
    # A lease long enough for both prefills and a scrape on a loaded 2-core
    # machine (0.2 s could end the first before the second was counted).
    async with fake_engines(EngineSpec(role=Role.PRODUCER, lease_s=1.0)) as urls:
        await prefill(session, urls[0], COMPLETIONS, completion_body())
        await prefill(session, urls[0], COMPLETIONS, completion_body(prompt="short"))
        assert await metric(session, urls[0], HELD) == 6
        for _ in range(100):
            await asyncio.sleep(0.05)
            if await metric(session, urls[0], HELD) == 0:
                break
        assert await metric(session, urls[0], HELD) == 0


async def test_plain_and_aborted_requests_hold_nothing(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(EngineSpec(role=Role.PRODUCER)) as urls:
        assert (await post(session, urls[0] + COMPLETIONS, completion_body()))[0] == 200
        assert await metric(session, urls[0], HELD) == 0
        engine = urls.engine(0)
        assert engine.kv.pool.num_free == engine.kv.pool.num_usable


async def test_a_stopped_engine_refuses_connections_and_the_others_serve(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(EngineSpec(), EngineSpec()) as urls:
        await urls.stop(1)
        with pytest.raises(aiohttp.ClientConnectionError):
            await post(session, urls[1] + COMPLETIONS, completion_body())
        assert (await post(session, urls[0] + COMPLETIONS, completion_body()))[0] == 200


async def test_a_prefill_waiting_for_blocks_runs_once_held_kv_is_dropped(
    session: aiohttp.ClientSession,
) -> None:
    # 7 usable blocks: one held prompt of 5 leaves too few for another.
    producer = EngineSpec(role=Role.PRODUCER, num_blocks=8, max_model_len=96)
    async with fake_engines(producer) as urls:
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        second = asyncio.create_task(
            prefill(session, urls[0], COMPLETIONS, completion_body(prompt="x" * 70))
        )
        done, _ = await asyncio.wait({second}, timeout=0.3)
        assert not done
        status, _ = await post(
            session, urls[0] + ABORT, {"request_ids": [params["remote_request_id"]]}
        )
        assert status == 200
        assert (await asyncio.wait_for(second, 5))["remote_num_tokens"] == 70


async def test_a_consumer_gone_before_its_pull_is_answered_is_no_error(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # A consumer that gave the load up (its request was aborted) has closed
    # the connection by the time the producer answers: aiohttp then refuses
    # the answer's first write.
    async with fake_engines(EngineSpec(role=Role.PRODUCER)) as urls:
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        source = RemoteSource.from_params(params)
        assert source is not None
        body = encode_pull_request(
            PullRequest(source.engine_id, source.request_id, source.block_ids)
        )
        payload = StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
        payload.feed_data(body)
        payload.feed_eof()
        writer = mock.Mock()
        writer.write_headers = mock.AsyncMock(
            side_effect=ClientConnectionResetError("Cannot write to closing transport")
        )
        request = make_mocked_request("POST", PULL_PATH, payload=payload, writer=writer)
        await urls.servers[0].pull(request)
        held = await metric(session, urls[0], HELD)
    assert held == 0  # released as pulled once gathered
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
