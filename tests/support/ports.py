"""Free local ports for servers a test starts."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path

# Ports handed out by free_port in this process.
_PORTS: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections."""
    try:
        return int(
            Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        )
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, kind: socket.SocketKind) -> bool:
    with socket.socket(socket.AF_INET, kind) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, udp: bool = False) -> int:
    """A TCP port (and UDP too, with ``udp``) free on 127.0.0.1 now, never
    handed out before in this process.

    Chosen below the range the kernel takes outgoing connections' local
    ports from: a server may bind its port a while after it is chosen (NIXL's
    side channel: a minute or more), and a port chosen in that range was seen
    taken by then ("Address already in use") by some outgoing connection.

    Raises:
        RuntimeError: If no free port is found.
    """
    rng = random.Random()
    kinds = [socket.SOCK_STREAM, socket.SOCK_DGRAM] if udp else [socket.SOCK_STREAM]
    for _ in range(1000):
        port = rng.randrange(10000, _ephemeral_low())
        if port in _PORTS or not all(_bindable(port, kind) for kind in kinds):
            continue
        _PORTS.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A port on 127.0.0.1 whose connections time out: a listening socket
    whose accept queue one connection it never accepts has filled, so the
    kernel drops further connection requests (Linux), as a host that lost
    its network would."""
    with socket.socket() as server, socket.socket() as filler:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        filler.connect(server.getsockname())
        yield int(server.getsockname()[1])
