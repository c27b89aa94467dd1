"""Fake engines for tests: several in one process, on free 127.0.0.1 ports.

async with fake_engines(EngineSpec(role=Role.PRODUCER), EngineSpec()) as urls:
    prefill, decode = urls          # "http://127.0.0.1:PORT"
    ...
    await urls.stop(1)              # kill the decode mid-test
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

from fake_engine.config import EngineConfig
from fake_engine.engine import Engine
from fake_engine.server import EngineServer

# An engine's settings: the CLI's flags (small model shapes by default).
EngineSpec = EngineConfig


class EngineURLs(list[str]):
    """The engines' base URLs, in the order of their specs, with a handle on
    each engine."""

    def __init__(self, servers: list[EngineServer], urls: list[str]) -> None:
        super().__init__(urls)
        self.servers = servers

    def engine(self, index: int) -> Engine:
        return self.servers[index].engine

    async def stop(self, index: int) -> None:
        """Stop one engine: its requests are aborted and its port closes."""
        await self.servers[index].stop()


@asynccontextmanager
async def fake_engines(
    *specs: EngineSpec, host: str = "127.0.0.1"
) -> AsyncIterator[EngineURLs]:
    """Start an engine per spec; stop them all on exit.

    Torch runs one intra-op thread meanwhile (``torch_threads``): each
    engine computes in a thread of its own on tiny tensors.
    """
    servers: list[EngineServer] = []
    urls = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spec in specs:
            server = EngineServer(Engine(spec))
            servers.append(server)
            port = await server.start(host, 0)
            urls.append(f"http://{host}:{port}")
        yield EngineURLs(servers, urls)
    finally:
        for server in servers:
            await server.stop()
        torch.set_num_threads(threads)
