"""KVGuard on a sliding-window model in real vLLM 0.32 (CPU), with different
block sizes on the two sides: P/D over NixlConnector, the KVGuard proxy in
front. The model is the tiny llama with layer 0 windowed (64 tokens) and
layer 1 full (``scripts/make_tiny_model.py --sliding-window 64``), so vLLM
makes a sliding-window group and a full-attention group.

The producer runs blocks of 32 tokens, the consumer of 64: vLLM's CPU
attention takes only multiples of 32 (``CPUAttentionBackend.
get_supported_kernel_block_sizes``), so 16 cannot be one of them. Prompts are
longer than the window, so the consumer keeps only the window's blocks of
the sliding-window group, whose checksums (16 tokens each) line up with the
producer's.

KVGuard's scheduler class only (same-step verdicts): the connector-only
mode holds loads whatever their groups, and test_vllm_pd covers it.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from own_model_pair import (
    CONSUMER,
    PRODUCER,
    assert_caught_and_retried,
    covered_groups,
    ensure_model,
    start_pair,
    stop_pair,
    through_proxy,
)
from vllm_servers import WORK_DIR, EngineSpec, Servers, complete, prompts

from engine_patch.payload import KVChecksumPayload

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(900),
]
# Runs after the tiny llama's tests (conftest.py): it stops their instances.
OWN_MODEL = True

WINDOW = 64
PRODUCER_BLOCK, CONSUMER_BLOCK = 32, 64
MAX_TOKENS = 8
# 60 to 120 words: 120 to 250 tokens or so, all longer than the window.
PROMPTS = prompts(6, seed=11, words=(60, 120))


def model() -> str:
    return ensure_model(
        WORK_DIR / "tiny-llama-sliding",
        "make_tiny_model.py",
        "--sliding-window",
        str(WINDOW),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pair(servers: Servers) -> AsyncIterator[Servers]:
    """A KVGuard producer (blocks of 32) of the sliding-window model and a
    consumer (blocks of 64) corrupting the sliding-window KV of every other
    load it makes (its first, third, ...), the proxy in front."""
    await start_pair(
        servers,
        EngineSpec("producer", model=model(), block_size=PRODUCER_BLOCK),
        EngineSpec(
            "consumer",
            "faults",
            faults=(("loads", "every_other"), ("layers", "sliding_window")),
            model=model(),
            block_size=CONSUMER_BLOCK,
        ),
    )
    try:
        yield servers
    finally:
        stop_pair(servers)


async def test_both_kinds_of_group_are_checksummed_and_sent(
    http: aiohttp.ClientSession, pair: Servers
) -> None:
    for name in (PRODUCER, CONSUMER):
        groups = covered_groups(pair, name)
        assert "sliding_window" in groups and "full_attention" in groups, groups
    status, answer = await complete(
        http,
        pair.engine(PRODUCER).url,
        PROMPTS[0],
        max_tokens=1,
        request_id="sliding-params",
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    num_tokens = params["remote_num_tokens"]
    assert num_tokens > 2 * WINDOW
    payload = KVChecksumPayload.from_bytes(base64.b64decode(params["kv_checksums"]))
    # The full-attention group: a value per block of 32 tokens; the
    # sliding-window group: a value per 16 tokens of the blocks sent.
    spans = sorted(
        (span, start, len(values)) for _, span, start, values in payload.groups.values()
    )
    (window_span, window_start, window_values), full = spans
    assert full == (PRODUCER_BLOCK, 0, -(-num_tokens // PRODUCER_BLOCK)), spans
    assert window_span == 16, spans
    assert window_start * 16 + window_values * 16 >= num_tokens


async def test_loads_across_block_sizes_verify_and_corrupted_ones_are_retried(
    http: aiohttp.ClientSession, pair: Servers
) -> None:
    stage = await through_proxy(http, pair, PROMPTS, MAX_TOKENS, "sliding")
    # Each request's first load had its windowed KV corrupted; its retry, a
    # clean load from blocks of 32 into blocks of 64, verified: every token
    # the consumer kept compared, none unverified.
    assert all(stage.answers.values())
    assert_caught_and_retried(stage, len(PROMPTS))
    consumer = pair.engine(CONSUMER)
    assert consumer.log_count("layer model.layers.0.self_attn.attn") >= stage.corrupted
