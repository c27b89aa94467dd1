"""KVGuard across tensor-parallel sizes in real vLLM 0.32 (CPU): a producer
of TP 1 with a consumer of TP 2, and a producer of TP 2 with a consumer of
TP 1, P/D over NixlConnector (which splits or joins the KV heads between
the two sides' ranks), the proxy in front.

The TP-2 instance's ranks each checksum the one KV head of the tiny llama's
two that they hold, and its scheduler adds the two ranks' sums; the TP-1
instance's one rank covers both heads (docs/checksum.md: additive over TP
shards). A clean load verifies only if both halves are right; a corrupted
one is caught and retried through the proxy.
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
    PRODUCER,
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
# A worker's startup line for the KV layers it checksums, and its rank (none
# at TP 1).
_CHECKSUMS = re.compile(
    r"\(Worker(?:_TP(\d))? pid=\d+\) .* KVGuard checksums 2 KV layers"
)
# OpenMP bound a rank per core (vLLM's NIXL worker then moves each rank's
# main thread to the last core: docs/vllm.md).
_TP2 = {
    "env": (("VLLM_CPU_OMP_THREADS_BIND", "0|1"),),
    "args": ("--tensor-parallel-size", "2"),
}


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="session",
    params=[(1, 2), (2, 1)],
    ids=["tp1-to-tp2", "tp2-to-tp1"],
)
async def pair(
    request: pytest.FixtureRequest, servers: Servers
) -> AsyncIterator[tuple[Servers, int, int]]:
    """A KVGuard producer and a fail-closed consumer corrupting every other
    load, one of them of TP 2, the proxy in front; with their TP sizes."""
    producer_tp, consumer_tp = request.param
    await start_pair(
        servers,
        EngineSpec("producer", **(_TP2 if producer_tp == 2 else {})),
        EngineSpec(
            "consumer",
            "faults",
            faults=(("loads", "every_other"),),
            **(_TP2 if consumer_tp == 2 else {}),
        ),
    )
    try:
        yield servers, producer_tp, consumer_tp
    finally:
        stop_pair(servers)


async def test_loads_across_tp_sizes_verify_and_corrupted_ones_are_retried(
    http: aiohttp.ClientSession, pair: tuple[Servers, int, int]
) -> None:
    servers, producer_tp, consumer_tp = pair
    for name, tp in ((PRODUCER, producer_tp), (CONSUMER, consumer_tp)):
        log = servers.engine(name).log_path.read_text(errors="replace")
        ranks = [str(rank) for rank in range(tp)] if tp > 1 else [""]
        assert sorted(_CHECKSUMS.findall(log)) == ranks
    stage = await through_proxy_as_alone(http, servers, PROMPTS, MAX_TOKENS, "tp")
    # Each consumer rank's injector flips a bit of its part of a corrupted
    # load.
    assert stage.corrupted % consumer_tp == 0
    assert_caught_and_retried(
        replace(stage, corrupted=stage.corrupted // consumer_tp), len(PROMPTS)
    )
