"""The proxy's connections to its backends.

Pooled connections are dropped after ``keepalive_s`` idle, which must stay
below the backends' own idle timeout (uvicorn, vLLM's server: 5 s). A backend
may still close a pooled connection just as a request goes out on it; the
request then fails before any reply byte with a reset or a disconnect. Such a
failure says nothing about the backend, so it is retried once on a new
connection, as RFC 9112 (9.3.1.1) allows for a connection the server closed,
and aiohttp does for idempotent methods only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import aiohttp
from yarl import URL


class ReplyTooLarge(Exception):
    """A backend's reply body is larger than the configured limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"reply exceeds {limit} bytes")
        self.limit = limit


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
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


class Upstream:
    """A pooled session for every call, and a non-pooled one for retries.

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
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=0, force_close=True, ttl_dns_cache=300
            ),
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._on_reconnect = on_reconnect

    async def post(
        self,
        url: URL,
        body: bytes,
        headers: Mapping[str, str],
        client_timeout: aiohttp.ClientTimeout,
        label: str,
    ) -> aiohttp.ClientResponse:
        """POSTs ``body``; the caller releases the response.

        A connection closed or reset before the reply's status line is
        retried once, on a new connection.

        Raises:
            TimeoutError: ``client_timeout`` ran out.
            aiohttp.ClientError: the backend could not be reached or answer
                (on the retry, for a closed or reset connection).
        """
        try:
            return await self.session.post(
                url, data=body, headers=headers, timeout=client_timeout
            )
        except aiohttp.ClientConnectorError:
            raise  # nothing was sent: the backend is not reachable
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            self._on_reconnect(label)
        return await self._fresh.post(
            url, data=body, headers=headers, timeout=client_timeout
        )

    async def close(self) -> None:
        await self.session.close()
        await self._fresh.close()
