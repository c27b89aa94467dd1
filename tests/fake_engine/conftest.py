"""Fixtures for the fake engine's tests (helpers live in fake_engine_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from fake_engine_helpers import MAX_MODEL_LEN

from fake_engine.testing import EngineSpec, fake_engines


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


@pytest.fixture
async def url() -> AsyncIterator[str]:
    """One fake engine (both roles) of ``MAX_MODEL_LEN`` tokens."""
    async with fake_engines(EngineSpec(max_model_len=MAX_MODEL_LEN)) as urls:
        yield urls[0]
