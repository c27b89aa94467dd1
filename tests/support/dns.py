"""What a resolver answers, for tests that stand in for DNS."""

from __future__ import annotations

import socket
from collections.abc import Iterable

from aiohttp.abc import ResolveResult


def resolved(host: str, port: int, addresses: Iterable[str]) -> list[ResolveResult]:
    """``host``'s ``addresses`` (IPv4 or IPv6) as an aiohttp resolver
    returns them."""
    return [
        ResolveResult(
            hostname=host,
            host=address,
            port=port,
            family=socket.AF_INET6 if ":" in address else socket.AF_INET,
            proto=0,
            flags=0,
        )
        for address in addresses
    ]
