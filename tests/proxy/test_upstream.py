"""The legs' HTTP client (proxy/upstream.py): a connection is reused only
after its reply was read whole, and never carries one reply into the next."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from proxy.upstream import ReplyTooLarge, Upstream, UpstreamResponse, read_capped

NO_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5)


class Backend:
    """A server that answers ``POST /`` with what each test asks, and
    counts the connections its requests came on."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.headers: list[dict[str, str]] = []
        self.bodies: list[bytes] = []
        self.url = URL()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        self.headers.append(dict(request.headers))
        self.bodies.append(await request.read())
        mode = request.query.get("mode", "json")
        if mode == "close":
            return web.Response(body=b"{}", headers={"Connection": "close"})
        if mode == "stream":
            resp = web.StreamResponse()
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b"data: %d\n\n" % i)
            await resp.write_eof()
            return resp
        if mode in ("sized", "chunked"):
            size = int(request.query["size"])
            if mode == "sized":
                return web.Response(body=b"x" * size)
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for _ in range(size // 1000):
                await resp.write(b"x" * 1000)
            await resp.write(b"x" * (size % 1000))
            await resp.write_eof()
            return resp
        if mode == "slow":
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"data: 0\n\n")
            await asyncio.sleep(1.5)
            return resp
        return web.json_response({"n": len(self.peers)})

    @property
    def connections(self) -> int:
        return len(set(self.peers))


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    server = Backend()
    app = web.Application()
    app.router.add_post("/", server.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.url = URL(f"http://127.0.0.1:{port}/")
    yield server
    await runner.cleanup()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream(keepalive_s=30, on_reconnect=lambda label: None)
    yield client
    await client.close()


async def post(
    upstream: Upstream, url: URL, limits: aiohttp.ClientTimeout = NO_TIMEOUT
) -> UpstreamResponse:
    return await upstream.post(
        url, b'{"x": 1}', {"Content-Type": "application/json"}, limits, "prefill"
    )


async def test_a_reply_read_whole_leaves_its_connection_for_the_next_request(
    backend, upstream
):
    for n in (1, 2, 3):
        async with await post(upstream, backend.url) as resp:
            assert resp.status == 200
            assert await read_capped(resp, 1000) == b'{"n": %d}' % n
    assert backend.connections == 1
    assert backend.bodies == [b'{"x": 1}'] * 3
    assert backend.headers[0]["Content-Type"] == "application/json"
    assert backend.headers[0]["Host"] == f"127.0.0.1:{backend.url.port}"


async def test_the_connections_of_concurrent_requests_are_all_pooled(backend, upstream):
    """Each connection read whole goes back to the pool, not only the last."""

    async def one() -> None:
        async with await post(upstream, backend.url) as resp:
            await read_capped(resp, 1000)

    for _ in range(3):
        await asyncio.gather(one(), one(), one())
    assert backend.connections == 3


async def test_a_stream_read_to_its_end_is_pooled_too(backend, upstream):
    for _ in range(2):
        resp = await post(upstream, backend.url.with_query(mode="stream"))
        data = b"".join([chunk async for chunk in resp.content.iter_any()])
        assert data == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        resp.release()
    assert backend.connections == 1


@pytest.mark.parametrize("framing", ["sized", "chunked"])
async def test_a_reply_of_exactly_the_limit_is_read_and_one_byte_more_is_not(
    backend, upstream, framing
):
    """With a Content-Length or chunked, the limit is the largest reply read."""
    limit = 4500
    url = backend.url.with_query(mode=framing, size=limit)
    async with await post(upstream, url) as resp:
        assert await read_capped(resp, limit) == b"x" * limit
    url = backend.url.with_query(mode=framing, size=limit + 1)
    async with await post(upstream, url) as resp:
        with pytest.raises(ReplyTooLarge):
            await read_capped(resp, limit)


async def test_a_reply_released_before_its_end_closes_its_connection(backend, upstream):
    resp = await post(upstream, backend.url.with_query(mode="slow"))
    assert await resp.content.readany() == b"data: 0\n\n"  # more is to come
    resp.release()
    async with await post(upstream, backend.url) as resp:
        # The next reply is this request's own, on a new connection.
        assert await resp.read() == b'{"n": 2}'
    assert backend.connections == 2


async def test_a_closed_reply_is_not_pooled(backend, upstream):
    async with await post(upstream, backend.url) as resp:
        await resp.read()
    resp = await post(upstream, backend.url)
    await resp.content.read()
    resp.close()  # read whole, but the caller gave it up
    async with await post(upstream, backend.url.with_query(mode="close")) as resp:
        await resp.read()
    async with await post(upstream, backend.url) as resp:
        await resp.read()
    assert backend.connections == 3


async def test_a_reply_dropped_unreleased_closes_its_connection(backend, upstream):
    resp = await post(upstream, backend.url.with_query(mode="slow"))
    conn = resp._proto
    del resp
    gc.collect()
    assert conn.transport is None
    assert not upstream._busy


async def test_idle_connections_past_keepalive_are_not_reused(backend):
    client = Upstream(keepalive_s=0.05, on_reconnect=lambda label: None)
    try:
        for _ in range(2):
            async with await post(client, backend.url) as resp:
                await resp.read()
            await asyncio.sleep(0.1)
    finally:
        await client.close()
    assert backend.connections == 2


async def test_a_header_with_a_line_break_is_refused_before_sending(backend, upstream):
    with pytest.raises(ValueError, match="header"):
        await upstream.post(
            backend.url, b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}, NO_TIMEOUT, "decode"
        )
    assert backend.peers == []


async def test_an_unreachable_backend_is_a_connector_error(upstream):
    with socket_bound() as port, pytest.raises(aiohttp.ClientConnectorError):
        await post(upstream, URL(f"http://127.0.0.1:{port}/"))


async def test_the_total_timeout_covers_reading_the_body(backend, upstream):
    timeout = aiohttp.ClientTimeout(total=0.3, sock_connect=5)
    resp = await post(upstream, backend.url.with_query(mode="slow"), timeout)
    assert await resp.content.readany() == b"data: 0\n\n"
    with pytest.raises(TimeoutError):
        await resp.content.readany()
    resp.close()


async def test_a_pooled_connection_the_backend_reset_is_retried_once(backend):
    reconnects: list[str] = []
    client = Upstream(keepalive_s=30, on_reconnect=reconnects.append)
    try:
        async with await post(client, backend.url) as resp:
            await resp.read()
        # The pooled connection breaks under the client's feet, still open
        # on the pool's side.
        (conn,) = client._idle[("127.0.0.1", backend.url.port, False)]
        sock = conn.transport.get_extra_info("socket")
        sock.shutdown(2)
        async with await post(client, backend.url) as resp:
            assert resp.status == 200
            await resp.read()
    finally:
        await client.close()
    assert reconnects == ["prefill"]


class socket_bound:
    """A port bound and not listening: connecting to it is refused."""

    def __enter__(self) -> int:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


async def test_interim_replies_before_the_reply_are_skipped(upstream):
    """100 Continue and 103 Early Hints (a gateway's, say) precede the reply
    the leg reads; the connection is pooled after it as after any other."""
    requests = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        nonlocal requests
        with contextlib.suppress(asyncio.IncompleteReadError):  # the client left
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(len(b'{"x": 1}'))
                requests += 1
                body = b'{"n": %d}' % requests
                writer.write(
                    b"HTTP/1.1 100 Continue\r\n\r\n"
                    b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
                )

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/")
    try:
        for n in (1, 2):
            async with await post(upstream, url) as resp:
                assert resp.status == 200
                assert await resp.read() == b'{"n": %d}' % n
        assert len(upstream._idle[("127.0.0.1", url.port, False)]) == 1
    finally:
        server.close()
