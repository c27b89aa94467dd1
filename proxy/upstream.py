"""The proxy's connections to its backends.

A request's legs (prefill, decode) go out through :class:`Upstream.post`, a
lean HTTP/1.1 client on aiohttp's own response protocol: aiohttp's parser
(llhttp), its body stream with flow control, and its mapping of a dropped
connection to ``ServerDisconnectedError``/``ClientOSError``. What it leaves
out of ``aiohttp.ClientSession`` is what a P/D leg never needs (redirects,
cookies, proxies, tracing, multipart bodies, per-request header merging):
that layer costs about 0.2 ms of CPU per call, two calls per request, on a
proxy whose whole budget is below 1 ms (``benchmarks/bench_proxy.py``).
Health checks, aborts and other rare calls keep ``Upstream.session``.

Pooled connections are dropped after ``keepalive_s`` idle, which must stay
below the backends' own idle timeout (uvicorn, vLLM's server: 5 s). A backend
may still close a pooled connection just as a request goes out on it; the
request then fails before any reply byte with a reset or a disconnect. Such a
failure says nothing about the backend, so it is retried once on a new
connection, as RFC 9112 (9.3.1.1) allows for a connection the server closed,
and aiohttp does for idempotent methods only.

A connection goes back to the pool only once its reply was read to the end
and neither side asked to close it; anything else closes it, so a reply can
never be read by the next request on the connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from types import TracebackType

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.helpers import BaseTimerContext, TimeoutHandle
from aiohttp.http_writer import _serialize_headers
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# Interim replies (100 Continue, 103 Early Hints) come before the reply;
# 101 (Switching Protocols) is the last one HTTP/1.1 sends.
_INTERIM_CODES = range(100, 200)


class ReplyTooLarge(Exception):
    """A backend's reply body is larger than the configured limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"reply exceeds {limit} bytes")
        self.limit = limit


async def read_capped(
    resp: UpstreamResponse | aiohttp.ClientResponse, limit: int
) -> bytes:
    """The whole body of ``resp``, refused beyond ``limit`` bytes.

    Raises:
        ReplyTooLarge: the body (announced or read so far) exceeds ``limit``.
        aiohttp.ClientError: the connection broke.
    """
    length = resp.content_length
    if length is not None:
        if length > limit:
            raise ReplyTooLarge(limit)
        return await resp.read()
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise ReplyTooLarge(limit)
    return bytes(buf)


class UpstreamResponse:
    """A backend's reply, its body still to read: the part of
    ``aiohttp.ClientResponse`` a leg uses.

    ``release()`` hands the connection back to the pool if the body was read
    to its end and nobody asked to close it, and closes it otherwise;
    ``close()`` always closes it. Either ends the reply's total timeout.
    """

    __slots__ = ("_done", "_on_release", "_proto", "content", "headers", "status")

    def __init__(
        self,
        status: int,
        headers: CIMultiDictProxy[str],
        content: StreamReader,
        proto: _Connection,
        on_release: Callable[[_Connection, bool], None],
    ) -> None:
        self.status = status
        self.headers = headers
        self.content = content
        self._proto = proto
        self._done = False
        self._on_release = on_release

    @property
    def content_length(self) -> int | None:
        """The announced body length (the parser checked it is a number)."""
        value = self.headers.get("Content-Length")
        return None if value is None else int(value)

    async def read(self) -> bytes:
        """The rest of the body; then the connection is released.

        Raises:
            aiohttp.ClientError: the connection broke.
            TimeoutError: the request's total timeout ran out.
        """
        data = await self.content.read()
        self.release()
        return data

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._on_release(self._proto, self.content.is_eof())

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._on_release(self._proto, False)

    def __del__(self) -> None:
        # A reply dropped unreleased (a bug) must not hold its connection.
        if not self._done:
            self.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class _Connection(ResponseHandler):
    """aiohttp's response protocol, with what the pool needs to know."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]):
        super().__init__(loop)
        self.key = key
        self.idle_since = 0.0
        self.timer_handle: asyncio.TimerHandle | None = None


class Upstream:
    """Pooled keep-alive connections for the legs, and an aiohttp session
    for every other call.

    Neither keeps cookies: a backend's ``Set-Cookie`` (a gateway's sticky
    session, say) answers one client's request and must not ride along on
    other clients' requests, nor to other backends on the same host.
    """

    def __init__(self, keepalive_s: float, on_reconnect: Callable[[str], None]) -> None:
        """``on_reconnect(label)`` is told of each retry on a new connection."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                limit_per_host=0,
                keepalive_timeout=keepalive_s,
                ttl_dns_cache=300,
            ),
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._keepalive_s = keepalive_s
        self._on_reconnect = on_reconnect
        self._idle: dict[tuple[str, int, bool], deque[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def post(
        self,
        url: URL,
        body: bytes,
        headers: Mapping[str, str],
        client_timeout: aiohttp.ClientTimeout,
        label: str,
    ) -> UpstreamResponse:
        """POSTs ``body``; the caller releases (or closes) the response.

        ``client_timeout.sock_connect`` bounds a new connection,
        ``client_timeout.total`` the request up to the end of its reply's
        body. A pooled connection closed or reset before the reply's status
        line is retried once, on a new connection.

        Raises:
            TimeoutError: ``client_timeout`` ran out
                (``aiohttp.ConnectionTimeoutError`` while connecting).
            aiohttp.ClientError: the backend could not be reached or answer
                (on the retry, for a closed or reset connection).
            ValueError: a header name or value holds a CR or LF.
        """
        loop = asyncio.get_running_loop()
        key = (url.raw_host or "", url.port or 80, url.scheme == "https")
        fields = CIMultiDict(headers)
        fields["Host"] = url.host_port_subcomponent or ""
        fields["Content-Length"] = str(len(body))
        # aiohttp's own serializer: it refuses CR and LF in names and values.
        head = _serialize_headers(f"POST {url.raw_path_qs} HTTP/1.1", fields)
        handle = TimeoutHandle(
            loop, client_timeout.total, ceil_threshold=client_timeout.ceil_threshold
        )
        timer_handle = handle.start()
        timer = handle.timer()
        try:
            with timer:
                conn = self._take(key, loop.time())
                if conn is not None:
                    try:
                        return await self._send(conn, head, body, timer, timer_handle)
                    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                        self._on_reconnect(label)
                conn = await self._connect(url, key, client_timeout.sock_connect)
                return await self._send(conn, head, body, timer, timer_handle)
        except BaseException:
            if timer_handle is not None:
                timer_handle.cancel()
            raise

    def _take(self, key: tuple[str, int, bool], now: float) -> _Connection | None:
        """The most recently idle pooled connection, if one is still fresh."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self._keepalive_s and conn.is_connected():
                return conn
            conn.close()
        return None

    async def _connect(
        self, url: URL, key: tuple[str, int, bool], sock_connect: float | None
    ) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, is_ssl = key
        context: ssl.SSLContext | None = None
        if is_ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(sock_connect):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if is_ssl else None,
                )
        except TimeoutError as exc:
            raise aiohttp.ConnectionTimeoutError(
                f"Connection timeout to host {url}"
            ) from exc
        except OSError as exc:
            conn_key = ConnectionKey(host, port, is_ssl, True, None, None, None, None)
            raise aiohttp.ClientConnectorError(conn_key, exc) from exc
        return conn

    async def _send(
        self,
        conn: _Connection,
        head: bytes,
        body: bytes,
        timer: BaseTimerContext,
        timer_handle: asyncio.TimerHandle | None,
    ) -> UpstreamResponse:
        """Writes the request on ``conn`` and reads the reply's head."""
        conn.set_response_params(timer=timer)
        self._busy.add(conn)
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            while True:
                message, payload = await conn.read()
                if message.code not in _INTERIM_CODES or message.code == 101:
                    break
            if message.should_close:
                conn.force_close()
        except BaseException:
            self._busy.discard(conn)
            conn.close()
            raise
        conn.timer_handle = timer_handle
        return UpstreamResponse(
            message.code, message.headers, payload, conn, self._release
        )

    def _release(self, conn: _Connection, read_to_end: bool) -> None:
        self._busy.discard(conn)
        if conn.timer_handle is not None:
            conn.timer_handle.cancel()
            conn.timer_handle = None
        if (
            self._closed
            or not read_to_end
            or conn.should_close
            or not conn.is_connected()
        ):
            conn.close()
            return
        now = conn.idle_since = asyncio.get_running_loop().time()
        idle = self._idle.setdefault(conn.key, deque())
        # The oldest are at the left; the pool takes from the right.
        while idle and now - idle[0].idle_since >= self._keepalive_s:
            idle.popleft().close()
        idle.append(conn)

    async def close(self) -> None:
        """Closes every connection, pooled or in use, and the session."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        for conn in list(self._busy):
            conn.close()
        self._busy.clear()
        await self.session.close()
