"""The proxy in process, for tests and the demo: as ``kvguard proxy`` serves it.

async with running_proxy(config) as proxy:
    resp = await proxy.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
    proxy.state.pools_for("m")     # the live state
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.server import ProxyRunner
from proxy.state import STATE, ProxyState


@dataclass
class RunningProxy:
    """A proxy serving on ``url``, with a client session to it."""

    url: str
    app: web.Application
    session: aiohttp.ClientSession

    @property
    def state(self) -> ProxyState:
        return self.app[STATE]

    async def post(self, path: str, body: Any, **kwargs: Any) -> aiohttp.ClientResponse:
        """POSTs ``body`` (bytes as they are, else as JSON) to ``path``."""
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        return await self.session.post(self.url + path, data=data, **kwargs)

    async def metrics(self) -> str:
        """The proxy's /metrics text."""
        async with self.session.get(self.url + "/metrics") as resp:
            return await resp.text()


@asynccontextmanager
async def running_proxy(
    config: ProxyConfig | Mapping[str, Any],
    source: str | Path | None = None,
    host: str = "127.0.0.1",
    client_timeout_s: float = 60,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> AsyncIterator[RunningProxy]:
    """Serves ``config`` on a free port of ``host`` until the block ends.

    ``source`` is the YAML file a reload re-reads, with ``overrides`` (the
    command line's settings) on top. Served as ``proxy.cli``
    does (``ProxyRunner``, a client's disconnect cancels its handler).

    Raises:
        pydantic.ValidationError: ``config`` is a mapping that is not a valid
            configuration.
        ConfigError: a key the configuration names cannot be read.
    """
    if not isinstance(config, ProxyConfig):
        config = ProxyConfig.model_validate(config)
    app = create_app(config, source, overrides)
    runner = ProxyRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = runner.addresses[0][1]
        timeout = aiohttp.ClientTimeout(total=client_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            yield RunningProxy(f"http://{host}:{port}", app, session)
    finally:
        await runner.cleanup()
