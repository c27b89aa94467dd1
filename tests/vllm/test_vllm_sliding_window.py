"""KVGuard on a sliding-window model in real vLLM 0.32 (CPU), with different
block sizes on the two sides: P/D over NixlConnector, the KVGuard proxy in
front. The model is the tiny llama with layer 0 windowed (64 tokens) and
layer 1 full (``scripts/make_tiny_model.py --sliding-window 64``), so vLLM
makes a sliding-window group and a full-attention group.

The producer runs blocks of 32 tokens, the consumer of 64: vLLM's CPU
attention takes only multiples of 32 (``CPUAttentionBackend.
get_supported_kernel_block_sizes`` returns ``[MultipleOf(32)]``), so 16
cannot be one of them. Prompts are longer than the window: each side keeps
(and NixlConnector moves) only the window's last blocks of the
sliding-window group, ``cdiv(64, block) + 1`` of them.

vLLM 0.32's NixlConnector places those blocks wrongly when the producer's
first kept block does not start where the consumer's does:
``_map_block_ids_for_block_size_ratio`` (nixl/base_worker.py) pairs the
consumer's 32-token halves with the producer's blocks from the start of both
lists, so the KV lands 32 tokens early. With a window of 64 that happens
when the prompt's count of 32-token blocks is even. KVGuard catches each
such load as a mismatch; the others verify.

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
    covered_groups,
    ensure_model,
    start_pair,
    stop_pair,
)
from vllm_client import complete, deltas, error_message, metrics, prompts
from vllm_servers import WORK_DIR, EngineSpec, Servers

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
    """A KVGuard producer (blocks of 32) and consumer (blocks of 64) of the
    sliding-window model, fail-closed, the proxy in front."""
    await start_pair(
        servers,
        EngineSpec("producer", model=model(), block_size=PRODUCER_BLOCK),
        EngineSpec("consumer", model=model(), block_size=CONSUMER_BLOCK),
    )
    try:
        yield servers
    finally:
        stop_pair(servers)


def first_kept_token(num_tokens: int, block_size: int) -> int:
    """The first token of the blocks a side keeps of the sliding-window
    group for a prompt of ``num_tokens``: its last ``cdiv(WINDOW, block) +
    1`` blocks (NixlConnector's ``blocks_per_sw``)."""
    num_blocks = -(-num_tokens // block_size)
    kept = -(-WINDOW // block_size) + 1
    return max(0, num_blocks - kept) * block_size


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


async def test_loads_whose_windows_line_up_verify_and_misplaced_ones_are_caught(
    http: aiohttp.ClientSession, pair: Servers
) -> None:
    producer, consumer = pair.engine(PRODUCER), pair.engine(CONSUMER)
    before = await metrics(http, consumer.url)
    outcomes: dict[str, list[int]] = {"verified": [], "caught": []}
    for i, prompt in enumerate(PROMPTS):
        status, answer = await complete(
            http,
            producer.url,
            prompt,
            max_tokens=1,
            request_id=f"sliding-{i}",
            kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
        )
        assert status == 200, answer
        params = answer["kv_transfer_params"]
        num_tokens = params["remote_num_tokens"]
        assert num_tokens > WINDOW
        status, answer = await complete(
            http,
            consumer.url,
            prompt,
            max_tokens=MAX_TOKENS,
            request_id=f"sliding-{i}",
            kv_transfer_params=params,
        )
        lined_up = first_kept_token(num_tokens, PRODUCER_BLOCK) == first_kept_token(
            num_tokens, CONSUMER_BLOCK
        )
        if lined_up:
            assert status == 200, (num_tokens, answer)
            outcomes["verified"].append(num_tokens)
        else:
            # Misplaced by NixlConnector: caught, failed (fail-closed), the
            # blocks of the sliding-window group (0) named.
            assert status == 500, (num_tokens, answer)
            message = error_message(answer)
            assert "KV checksum mismatch" in message and "group 0" in message
            outcomes["caught"].append(num_tokens)
    change = deltas(await metrics(http, consumer.url), before)
    # Both kinds of load happened (the prompts are chosen so).
    assert outcomes["verified"] and outcomes["caught"], outcomes
    assert change.get("kvguard_kv_checksum_verified_total") == len(outcomes["verified"])
    assert change.get("kvguard_kv_checksum_mismatch_total") == len(outcomes["caught"])
    # Every load compared: none unverified, whatever the block sizes.
    assert change.get("kvguard_kv_checksum_unverified_total", 0.0) == 0
