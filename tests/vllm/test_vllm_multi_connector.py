"""KVGuard around vLLM's MultiConnector in real vLLM 0.32 (CPU): NIXL for
P/D and a second KV tier (ExampleConnector, on local disk), as deployments
pairing NIXL with LMCache or an offloading connector configure it, and with
every instance ``kv_both``, as vLLM's NIXL examples and llm-d run them.

vLLM turns its hybrid KV cache manager off for a MultiConnector one of whose
connectors lacks its support, as ExampleConnector and LMCache's do; with
KVGuard around it vLLM sees KVGuard's support and keeps the manager on.
KVGuard then gives the MultiConnector the config vLLM would have given it
(before, MultiConnector's own check stopped every such engine at startup).
Both instances of the pair run it; a P/D load goes through NIXL and is
verified, a corrupted one caught and retried through the proxy.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from own_model_pair import (
    CONSUMER,
    PRODUCER,
    assert_caught_and_retried,
    start_pair,
    stop_pair,
    through_proxy_as_alone,
)
from vllm_client import prompts
from vllm_servers import EXAMPLE_TIER_DIR, EngineSpec, Servers

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(900),
]
# Runs after the tiny llama's P/D tests (conftest.py): it stops their
# instances.
OWN_MODEL = True

MAX_TOKENS = 8
PROMPTS = prompts(4, seed=23)
# vLLM's warning when it turns the hybrid KV cache manager off for a
# connector.
HYBRID_OFF = "Turning off hybrid kv cache manager"
# ExampleConnector's line for a prompt it loads.
TIER_HIT = "External Cache Hit!"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pair(servers: Servers) -> AsyncIterator[Servers]:
    """A KVGuard producer and a fail-closed consumer corrupting every other
    load, each ``kv_both`` around MultiConnector[NIXL, ExampleConnector], the
    proxy in front; the second tier starts empty."""
    shutil.rmtree(EXAMPLE_TIER_DIR, ignore_errors=True)
    await start_pair(
        servers,
        EngineSpec("producer", multi_connector=True, kv_both=True),
        EngineSpec(
            "consumer",
            "faults",
            faults=(("loads", "every_other"),),
            multi_connector=True,
            kv_both=True,
        ),
    )
    try:
        yield servers
    finally:
        stop_pair(servers)


async def test_corrupted_loads_through_a_multi_connector_are_caught_and_retried(
    http: aiohttp.ClientSession, pair: Servers
) -> None:
    for name in (PRODUCER, CONSUMER):
        assert pair.engine(name).log_count(HYBRID_OFF) == 0
    # The producer answers alone first; its second tier then holds each prompt's
    # KV, which its prefills below load from there rather than compute.
    stage = await through_proxy_as_alone(http, pair, PROMPTS, MAX_TOKENS, "multi")
    assert_caught_and_retried(stage, len(PROMPTS))
    # Each prefill (first attempt and retry) loaded its prompt from the tier.
    hits = pair.engine(PRODUCER).log_count(TIER_HIT)
    assert hits >= len(PROMPTS) + stage.integrity_retries
