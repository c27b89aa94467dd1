"""P/D like vLLM's NixlConnector in pull mode: a decode that pulls its
prompt's KV from a prefill answers exactly what one engine answers alone,
across TP sizes, block sizes and dtypes, streamed or not, completions and
chat; and its load is verified by engine_patch's checksums."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    PROMPT,
    chat_body,
    completion_body,
    metric,
    pd,
    post,
    prefill,
    stream,
    streamed_text,
    text_of,
)

from engine_patch.payload import KVChecksumPayload, decode_base64
from fake_engine.config import Role
from fake_engine.testing import EngineSpec, fake_engines

PRODUCER = Role.PRODUCER
CONSUMER = Role.CONSUMER


@pytest.mark.parametrize(
    ("producer", "consumer"),
    [
        pytest.param({}, {}, id="tp1-to-tp1"),
        pytest.param({"tp_size": 2}, {}, id="tp2-to-tp1"),
        pytest.param({}, {"tp_size": 2}, id="tp1-to-tp2"),
        pytest.param({}, {"tp_size": 4}, id="tp1-to-tp4-replicated-heads"),
        pytest.param({}, {"block_size": 32}, id="block16-to-block32"),
        pytest.param(
            {"block_size": 32, "tp_size": 2},
            {"block_size": 16},
            id="tp2-block32-to-block16",
        ),
        pytest.param({"max_num_batched_tokens": 16}, {}, id="chunked-prefill"),
    ],
)
async def test_pd_text_equals_monolithic_streamed_or_not_completion_or_chat(
    session: aiohttp.ClientSession, producer: dict, consumer: dict
) -> None:
    specs = (
        EngineSpec(role=PRODUCER, fail_closed=True, **producer),
        EngineSpec(role=CONSUMER, fail_closed=True, **consumer),
        EngineSpec(**consumer),
        EngineSpec(**producer),
    )
    async with fake_engines(*specs) as urls:
        prefill_url, decode_url, alone_url, producer_alone_url = urls
        for path, body_of in ((COMPLETIONS, completion_body), (CHAT, chat_body)):
            _, alone = await post(session, alone_url + path, body_of())
            _, producer_alone = await post(
                session, producer_alone_url + path, body_of()
            )
            assert text_of(alone) == text_of(producer_alone)
            assert len(text_of(alone)) == 12
            status, decoded = await pd(
                session, prefill_url, decode_url, path, body_of()
            )
            assert status == 200, decoded
            assert text_of(decoded) == text_of(alone)
            assert decoded["kv_transfer_params"] is None
            params = await prefill(session, prefill_url, path, body_of())
            body = {**body_of(stream=True), "kv_transfer_params": params}
            status, events = await stream(session, decode_url + path, body)
            assert status == 200 and events[-1] == "[DONE]"
            assert streamed_text(events) == text_of(alone)
        assert (
            await metric(session, decode_url, "kvguard_kv_checksum_verified_total") == 4
        )
        assert await metric(session, prefill_url, "kvguard_kv_checksum_sent_total") == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
async def test_pd_verifies_every_kv_dtype(
    session: aiohttp.ClientSession, dtype: str
) -> None:
    specs = (
        EngineSpec(role=PRODUCER, dtype=dtype),
        EngineSpec(role=CONSUMER, dtype=dtype, tp_size=2, fail_closed=True),
        EngineSpec(dtype=dtype),
    )
    async with fake_engines(*specs) as urls:
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        status, decoded = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        assert status == 200, decoded
        assert text_of(decoded) == text_of(alone)
        assert await metric(session, urls[1], "kvguard_kv_checksum_verified_total") == 1


@pytest.fixture
async def pair():
    """A prefill (TP 2), a decode (block size 32) and a monolithic engine."""
    specs = (
        EngineSpec(role=PRODUCER, tp_size=2),
        EngineSpec(role=CONSUMER, block_size=32, fail_closed=True),
        EngineSpec(),
    )
    async with fake_engines(*specs) as urls:
        yield urls


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_pd_stream_equals_monolithic(
    session: aiohttp.ClientSession, pair: list[str], path: str
) -> None:
    prefill_url, decode_url, alone_url = pair
    body_of = completion_body if path == COMPLETIONS else chat_body
    status, alone = await post(session, alone_url + path, body_of())
    assert status == 200
    params = await prefill(session, prefill_url, path, body_of())
    body = body_of(stream=True, stream_options={"include_usage": True})
    status, events = await stream(
        session, decode_url + path, {**body, "kv_transfer_params": params}
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    assert streamed_text(events) == text_of(alone)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 12


async def test_pd_chat_non_stream_equals_monolithic(
    session: aiohttp.ClientSession, pair: list[str]
) -> None:
    prefill_url, decode_url, alone_url = pair
    _, alone = await post(session, alone_url + CHAT, chat_body())
    status, decoded = await pd(session, prefill_url, decode_url, CHAT, chat_body())
    assert status == 200, decoded
    assert decoded["object"] == "chat.completion"
    assert text_of(decoded) == text_of(alone)


async def test_prefill_returns_nixl_pull_params_with_checksums(
    session: aiohttp.ClientSession, pair: list[str]
) -> None:
    prefill_url = pair[0]
    params = await prefill(
        session, prefill_url, COMPLETIONS, completion_body(), "req-7"
    )
    host, port = prefill_url.removeprefix("http://").split(":")
    assert params["remote_host"] == host and params["remote_port"] == int(port)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"].startswith("cmpl-req-7-0-")
    assert params["tp_size"] == 2 and params["transfer_mode"] == "pull"
    assert params["remote_num_tokens"] == len(PROMPT)
    # vLLM's scheduler adds the prefill's prefix-cache hits: none here.
    assert params["remote_prefill_cached_tokens"] == 0
    # One list of block ids per KV cache group: 70 tokens in blocks of 16.
    assert (
        len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 5
    )
    payload = KVChecksumPayload.from_bytes(decode_base64(params["kv_checksums"]))
    assert payload.tp_size == 2 and payload.num_tokens == len(PROMPT)
    assert len(payload.groups[0][3]) == 5


async def test_concurrent_pd_requests_all_equal_monolithic(
    session: aiohttp.ClientSession, pair: list[str]
) -> None:
    prefill_url, decode_url, alone_url = pair
    prompts = [f"{i}: {PROMPT[: 20 + 6 * i]}" for i in range(8)]
    alone = await asyncio.gather(
        *(
            post(session, alone_url + COMPLETIONS, completion_body(prompt=p))
            for p in prompts
        )
    )
    decoded = await asyncio.gather(
        *(
            pd(session, prefill_url, decode_url, COMPLETIONS, completion_body(prompt=p))
            for p in prompts
        )
    )
    assert [text_of(r) for _, r in decoded] == [text_of(r) for _, r in alone]
    assert await metric(session, decode_url, "kvguard_kv_checksum_verified_total") == 8


async def test_workers_count_the_time_and_bytes_they_checksum(
    session: aiohttp.ClientSession, pair: list[str]
) -> None:
    prefill_url, decode_url, _ = pair
    start = time.perf_counter()
    await pd(session, prefill_url, decode_url, COMPLETIONS, completion_body())
    elapsed = time.perf_counter() - start
    for url in (prefill_url, decode_url):
        seconds = await metric(session, url, "kvguard_kv_checksum_seconds_total")
        assert 0 < seconds < elapsed
        assert await metric(session, url, "kvguard_kv_checksum_bytes_total") > 0


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(None, id="no-source"),
        pytest.param([], id="no-block-ids"),
        pytest.param([[]], id="an-empty-group"),
    ],
)
async def test_decode_without_remote_params_prefills_locally(
    session: aiohttp.ClientSession,
    pair: list[str],
    edit: list | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill_url, decode_url, alone_url = pair
    _, alone = await post(session, alone_url + COMPLETIONS, completion_body())
    # As vLLM: invalid kv_transfer_params are logged and not used. A source
    # with no blocks to pull has nothing to load from.
    if edit is None:
        params = {"do_remote_prefill": True}
    else:
        params = await prefill(session, prefill_url, COMPLETIONS, completion_body())
        params["remote_block_ids"] = edit
    body = completion_body(kv_transfer_params=params)
    with caplog.at_level(logging.WARNING, logger="fake_engine"):
        status, decoded = await post(session, decode_url + COMPLETIONS, body)
    assert status == 200
    assert text_of(decoded) == text_of(alone)
    assert "Got invalid KVTransferParams" in caplog.text
    assert await metric(session, decode_url, "kvguard_kv_checksum_verified_total") == 0


async def test_engine_with_both_roles_serves_as_prefill_and_decode(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(
        EngineSpec(), EngineSpec(tp_size=2, fail_closed=True)
    ) as urls:
        _, alone = await post(session, urls[0] + COMPLETIONS, completion_body())
        status, there = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        status_back, back = await pd(
            session, urls[1], urls[0], COMPLETIONS, completion_body()
        )
        assert status == status_back == 200
        assert text_of(there) == text_of(back) == text_of(alone)


async def test_preempted_requests_answer_as_without_preemption(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvguard.fake_engine.engine")
    # 9 usable blocks of 16 tokens: three requests start with 2 each and
    # grow to 5 each.
    small = EngineSpec(num_blocks=10, max_model_len=144)
    async with fake_engines(small, EngineSpec()) as urls:
        prompts = [f"{i} {PROMPT[:18]}" for i in range(3)]
        bodies = [completion_body(prompt=p, max_tokens=60) for p in prompts]
        squeezed = await asyncio.gather(
            *(post(session, urls[0] + COMPLETIONS, b) for b in bodies)
        )
        roomy = await asyncio.gather(
            *(post(session, urls[1] + COMPLETIONS, b) for b in bodies)
        )
        assert [r for _, r in squeezed] and all(s == 200 for s, _ in squeezed)
        assert [text_of(r) for _, r in squeezed] == [text_of(r) for _, r in roomy]
        assert "Preempting request" in caplog.text


async def test_simulated_prefill_speed_delays_the_answer(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(EngineSpec(prefill_tokens_per_s=700.0)) as urls:
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _ = await post(
            session, urls[0] + COMPLETIONS, completion_body(max_tokens=1)
        )
        assert status == 200
        # 70 prompt tokens at 700 tokens/s.
        assert loop.time() - started >= 0.09
