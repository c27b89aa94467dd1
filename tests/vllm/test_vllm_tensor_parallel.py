"""KVGuard across tensor-parallel sizes in real vLLM 0.32 (CPU): a producer
of TP 1 and a consumer of TP 2, P/D over NixlConnector (which splits the
producer's KV heads between the consumer's ranks), the proxy in front.

Each consumer rank checksums the one KV head of the tiny llama's two that it
holds; the scheduler adds the two ranks' sums and compares them with the
producer's, which covered both heads on one rank (docs/checksum.md:
additive over TP shards). A clean load verifies only if both halves are
right; a corrupted one is caught and retried through the proxy.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
import pytest_asyncio
from own_model_pair import (
    CONSUMER,
    assert_caught_and_retried,
    start_pair,
    stop_pair,
    through_proxy_as_alone,
)
from vllm_client import prompts
from vllm_servers import EngineSpec, Servers

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(900),
]
# Runs after the tiny llama's P/D tests (conftest.py): it stops their
# instances.
OWN_MODEL = True

MAX_TOKENS = 8
PROMPTS = prompts(4, seed=31)
# A worker's startup line for the KV layers it checksums, and its rank.
_CHECKSUMS = re.compile(r"\(Worker_TP(\d) pid=\d+\) .* KVGuard checksums 2 KV layers")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pair(servers: Servers) -> AsyncIterator[Servers]:
    """A KVGuard producer of TP 1 and a fail-closed consumer of TP 2 (a rank
    per core) corrupting every other load, the proxy in front."""
    await start_pair(
        servers,
        EngineSpec("producer"),
        EngineSpec(
            "consumer",
            "faults",
            faults=(("loads", "every_other"),),
            env=(("VLLM_CPU_OMP_THREADS_BIND", "0|1"),),
            args=("--tensor-parallel-size", "2"),
        ),
    )
    try:
        yield servers
    finally:
        stop_pair(servers)


async def test_loads_split_over_two_ranks_verify_and_corrupted_ones_are_retried(
    http: aiohttp.ClientSession, pair: Servers
) -> None:
    log = pair.engine(CONSUMER).log_path.read_text(errors="replace")
    assert sorted(_CHECKSUMS.findall(log)) == ["0", "1"]
    stage = await through_proxy_as_alone(http, pair, PROMPTS, MAX_TOKENS, "tp")
    # Both ranks' injectors flip a bit of their half of a corrupted load.
    assert stage.corrupted % 2 == 0
    assert_caught_and_retried(
        replace(stage, corrupted=stage.corrupted // 2), len(PROMPTS)
    )
