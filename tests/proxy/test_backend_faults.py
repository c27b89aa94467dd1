"""Backends that fail in ways that say nothing about their health, or hang:
the proxy must neither eject them nor keep a client waiting (issue 10)."""

from __future__ import annotations

import asyncio
import time

import pytest
from proxy_helpers import expected_text, make_config, read_sse

from proxy.config import ProxyConfig, TimeoutsConfig
from proxy.testing import running_proxy

COMPLETION = {"prompt": "hi", "max_tokens": 4}


def test_pooled_connections_are_dropped_before_vllms_idle_timeout():
    # uvicorn (vLLM's server) closes keep-alive connections idle for 5 s.
    assert TimeoutsConfig().backend_keepalive_s < 5


async def test_reset_on_a_reused_connection_is_retried_and_not_held_against_it(
    stubs,
):
    p, d = await stubs(reset_idle_s=0.2), await stubs(reset_idle_s=0.2)
    config = make_config(
        [p.url],
        [d.url],
        timeouts={"backend_keepalive_s": 30},  # keep them past the backends' 0.2 s
        health={"interval_s": 30, "unhealthy_threshold": 1},
    )
    async with running_proxy(config) as px:
        for stream in (False, True, False, True):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert resp.status == 200, await resp.text()
            await resp.read()
            await asyncio.sleep(0.3)
        metrics = await px.metrics()
        instances = list(px.state.all_instances())
    # Each request after the first goes out on the connection the one before
    # left in the pool (a retry's new connection is pooled too).
    assert p.resets == d.resets == 3
    assert all(i.healthy and i.consecutive_failures == 0 for i in instances)
    assert "kvguard_proxy_upstream_failures_total{" not in metrics
    assert "kvguard_proxy_retries_total{" not in metrics
    assert 'kvguard_proxy_backend_reconnects_total{role="prefill"}' in metrics


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_oversized_prefill_reply_fails_the_attempt_saying_why(stubs, chunked):
    big, ok, d = (
        await stubs(pad_bytes=200_000, chunked=chunked),
        await stubs(),
        await stubs(),
    )
    config = make_config(
        [big.url, ok.url],
        [d.url],
        limits={"max_reply_bytes": 65536},
        retry={"backoff_base_s": 0},
    )
    async with running_proxy(config) as px:
        for _ in range(2):  # round robin: one of them tries the big one first
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200
        metrics = await px.metrics()
    assert 'kvguard_proxy_retries_total{reason="prefill_reply_too_large"} 1.0' in (
        metrics
    )


def _one_attempt(p: str, d: str, max_reply_bytes: int) -> ProxyConfig:
    """One attempt per request (no retry to hide a failure), replies bounded."""
    return make_config(
        [p],
        [d],
        limits={"max_reply_bytes": max_reply_bytes},
        retry={"backoff_base_s": 0, "max_attempts": 1},
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_oversized_decode_reply_fails_saying_why(stubs, chunked):
    p, d = await stubs(), await stubs(pad_bytes=200_000, chunked=chunked)
    config = _one_attempt(p.url, d.url, 65536)
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        body = await resp.json()
    assert resp.status >= 500
    assert "exceeds 65536 bytes" in body["error"]["message"]


def _stream_of(size: int) -> list[bytes]:
    """One data event whose stream (its event and [DONE]) is ``size`` bytes."""
    head, tail = b'{"choices": [{"index": 0, "text": "', b'"}]}'
    framing = len(b"data: \n\n") + len(b"data: [DONE]\n\n")
    return [head + b"x" * (size - framing - len(head) - len(tail)) + tail]


async def test_a_stream_collected_for_a_whole_reply_may_be_max_reply_bytes_long(
    stubs,
):
    p, d = await stubs(), await stubs()
    config = _one_attempt(p.url, d.url, 4096)
    async with running_proxy(config) as px:
        d.events = _stream_of(4096)
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200, await resp.text()
        d.events = _stream_of(4097)
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status >= 500
        assert "exceeds 4096 bytes" in (await resp.json())["error"]["message"]


async def test_a_decode_streaming_more_than_max_reply_bytes_before_its_output_fails(
    stubs,
):
    # The proxy holds what comes before the first output, to retry: in
    # memory, so bounded as a reply is.
    p, d = await stubs(), await stubs(chunk_delay=0.001)  # one event per read
    d.events = [b'{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}'] * 100
    config = _one_attempt(p.url, d.url, 4096)
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        assert resp.status >= 500
        message = (await resp.json())["error"]["message"]
        await asyncio.sleep(0.1)
    assert "decode stream exceeds 4096 bytes before its output" in message
    assert len(d.aborts) == 1


POISON = {"prompt": [""], "max_tokens": 4}


def one_prefill_two_decodes(p: str, d1: str, d2: str) -> ProxyConfig:
    """Two failures take an instance out; no probe in time to bring it back."""
    return make_config(
        [p],
        [d1, d2],
        health={"interval_s": 60, "unhealthy_threshold": 2},
        retry={"backoff_base_s": 0},
    )


async def test_requests_no_decode_can_serve_take_no_decode_out_of_service(stubs):
    # Two decodes sharing one prefill fail the request alike, yet not "with
    # different prefills": the request or the prefill is at fault, not both
    # decodes.
    p = await stubs(poison_leg="decode")
    d1, d2 = await stubs(poison_leg="decode"), await stubs(poison_leg="decode")
    config = one_prefill_two_decodes(p.url, d1.url, d2.url)
    async with running_proxy(config) as px:
        for _ in range(3):
            resp = await px.post("/v1/completions", POISON)
            message = (await resp.json())["error"]["message"]
            # Every attempt made, none failing fast: the prefill may be at fault.
            assert resp.status == 503
            assert message.startswith("No instance could serve the request")
            assert "engine step failed" in message
        assert all(i.healthy for i in px.state.all_instances())
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200


async def test_a_decode_failing_what_another_serves_is_taken_out_of_service(stubs):
    p, bad, good = await stubs(), await stubs("error500"), await stubs()
    config = one_prefill_two_decodes(p.url, bad.url, good.url)
    async with running_proxy(config) as px:
        for _ in range(4):
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200
            await resp.read()
        healthy = {i.url: i.healthy for i in px.state.all_instances()}
    assert healthy == {p.url: True, bad.url: False, good.url: True}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
async def test_a_decode_that_breaks_every_stream_after_its_first_token_is_taken_out(
    stubs, stream
):
    # Its first token is no proof of health: each of its streams breaks.
    p, bad, good = await stubs(), await stubs("die"), await stubs()
    config = one_prefill_two_decodes(p.url, bad.url, good.url)
    body = {**COMPLETION, "stream": stream}
    async with running_proxy(config) as px:
        for _ in range(4):
            resp = await px.post("/v1/completions", body)
            await resp.read()
        healthy = {i.url: i.healthy for i in px.state.all_instances()}
        tried = len(bad.requests)
        for _ in range(4):
            resp = await px.post("/v1/completions", body)
            assert resp.status == 200
            if stream:
                assert await read_sse(resp) == (expected_text("hi", 4), [])
            else:
                assert (await resp.json())["choices"][0]["text"] == expected_text(
                    "hi", 4
                )
    assert tried == 2
    assert healthy == {p.url: True, bad.url: False, good.url: True}
    assert len(bad.requests) == tried


@pytest.mark.parametrize(
    "event",
    [
        b'"text"',
        b'{"choices": 5}',
        b'{"choices": [{"index": [1], "text": "a"}]}',
        b'{"choices": [{"index": "0", "text": "a"}]}',
        b'{"choices": [{"index": true, "text": "a"}]}',
        b'{"choices": [{"index": 0, "message": "a", "delta": {"content": "b"}}]}',
    ],
    ids=[
        "not-an-object",
        "choices-not-a-list",
        "index-a-list",
        "index-text",
        "index-bool",
        "message-text",
    ],
)
async def test_a_decode_streaming_no_reply_to_a_non_streaming_request_is_retried(
    stubs, event
):
    p, bad, good = await stubs(), await stubs(events=[event]), await stubs()
    config = one_prefill_two_decodes(p.url, bad.url, good.url)
    async with running_proxy(config) as px:
        for _ in range(4):
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == expected_text("hi", 4)
        metrics = await px.metrics()
        healthy = {i.url: i.healthy for i in px.state.all_instances()}
    assert bad.bodies("/v1/completions")
    assert f'instance="{bad.url}",reason="decode_bad_reply"' in metrics
    assert healthy == {p.url: True, bad.url: False, good.url: True}


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("size", [1, 2], ids=["1p1d", "2p2d"])
async def test_a_request_that_crashes_engines_takes_no_instance_out_of_service(
    stubs, leg, size
):
    # Issue 10's pattern, scaled down: one poison request every 0.3 s (the
    # issue: 3 s) while other clients keep sending; probes every second.
    prefills = [await stubs(poison_leg=leg) for _ in range(size)]
    decodes = [await stubs(poison_leg=leg) for _ in range(size)]
    config = make_config(
        [p.url for p in prefills],
        [d.url for d in decodes],
        health={"interval_s": 1.0, "unhealthy_threshold": 2},
        retry={"backoff_base_s": 0.001},
    )
    others: list[int] = []
    poison: list[tuple[int, float, str]] = []
    async with running_proxy(config) as px:
        stop = asyncio.Event()
        enough = asyncio.Event()

        def count() -> None:
            if len(others) > 50 and len(poison) >= 3:
                enough.set()

        async def client() -> None:
            while not stop.is_set():
                resp = await px.post("/v1/completions", COMPLETION)
                await resp.read()
                others.append(resp.status)
                count()
                await asyncio.sleep(0.005)

        async def poisoner() -> None:
            while not stop.is_set():
                started = time.monotonic()
                resp = await px.post("/v1/completions", POISON)
                message = (await resp.json())["error"]["message"]
                poison.append((resp.status, time.monotonic() - started, message))
                count()
                await asyncio.sleep(0.3)

        tasks = [asyncio.create_task(client()) for _ in range(4)]
        tasks.append(asyncio.create_task(poisoner()))
        # Two probe rounds and enough requests of each kind, however slow a
        # loaded machine makes them.
        await asyncio.sleep(2.5)
        await enough.wait()
        stop.set()
        await asyncio.gather(*tasks)
        healthy = [i.healthy for i in px.state.all_instances()]
    failed = [s for s in others if s != 200]
    assert len(others) > 50 and not failed, f"{len(failed)}/{len(others)} failed"
    assert all(healthy)
    assert len(poison) >= 3
    assert all(status >= 500 and "engine step failed" in m for status, _, m in poison)
    if size == 2:  # failed the same way on two instances: the client is told at once
        assert all(status == 500 and "two" in m for status, _, m in poison)
