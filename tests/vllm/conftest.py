"""Fixtures of the real-vLLM tests (``make test-vllm``): vLLM instances kept
up across the tests, and KVGuard proxies.

Collected only where vLLM is installed; the default suite deselects them
(marker ``vllm``) anyway.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import aiohttp
    import pytest_asyncio
    from vllm_servers import Servers, ensure_model

    @pytest_asyncio.fixture(scope="session", loop_scope="session")
    async def http() -> AsyncIterator[aiohttp.ClientSession]:
        # A connection per request: no reuse of one a server is closing.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            yield session

    @pytest_asyncio.fixture(scope="session", loop_scope="session")
    async def servers(http: aiohttp.ClientSession) -> AsyncIterator[Servers]:
        ensure_model()
        running = Servers(http)
        try:
            yield running
        finally:
            running.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs real vLLM (make test-vllm)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a model of their own (``OWN_MODEL``) run last: they stop
    the tiny llama's instances, which then start once."""
    items.sort(
        key=lambda item: getattr(getattr(item, "module", None), "OWN_MODEL", False)
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The vLLM servers' startup times (launch to /health)."""
    if importlib.util.find_spec("vllm") is None:
        return
    from vllm_servers import STARTUPS

    if STARTUPS:
        terminalreporter.section("vLLM startup times")
        for name, seconds in STARTUPS:
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
