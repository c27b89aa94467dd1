"""KVGuard on a hybrid model (Mamba2 + attention) in real vLLM 0.32 (CPU):
P/D over NixlConnector, the KVGuard proxy in front. The model is a tiny
random GraniteMoeHybrid made locally (scripts/make_tiny_hybrid_model.py):
layer 0 Mamba2, layer 1 attention, so vLLM makes a state group and an
attention group, and NixlConnector moves both.

NixlConnector moves state groups only in vLLM's "DS" conv state layout
(``VLLM_SSM_CONV_STATE_LAYOUT=DS``; its worker asserts it). vLLM sets the
attention block size so that an attention page holds a state page (64
tokens here), whatever ``--block-size`` says.

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
    through_proxy_as_alone,
)
from vllm_client import complete, prompts
from vllm_servers import WORK_DIR, EngineSpec, Servers

from engine_patch.payload import KVChecksumPayload

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(900),
]
# Runs after the tiny llama's tests (conftest.py): it stops their instances.
OWN_MODEL = True

DS_LAYOUT = (("VLLM_SSM_CONV_STATE_LAYOUT", "DS"),)
# vLLM's CPU Mamba2 kernel returns no per-chunk states, which prefix
# caching's "align" mode reads for prompts over a block: mamba_mixer2.py's
# ``varlen_states[last_chunk_indices_p]`` raises IndexError and kills the
# engine. Without prefix caching ("none" mode) it runs.
NO_PREFIX_CACHING = ("--no-enable-prefix-caching",)
FEW = 3
MAX_TOKENS = 12
PROMPTS = prompts(FEW, seed=7)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pair(servers: Servers) -> AsyncIterator[Servers]:
    """A KVGuard producer of the hybrid model and a consumer corrupting the
    state of every other load it makes (its first, third, ...), the proxy in
    front."""
    model = ensure_model(WORK_DIR / "tiny-hybrid", "make_tiny_hybrid_model.py")
    await start_pair(
        servers,
        EngineSpec("producer", model=model, env=DS_LAYOUT, args=NO_PREFIX_CACHING),
        EngineSpec(
            "consumer",
            "faults",
            faults=(("loads", "every_other"), ("layers", "mamba")),
            model=model,
            env=DS_LAYOUT,
            args=NO_PREFIX_CACHING,
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
        assert "mamba" in groups and "full_attention" in groups, groups
    status, answer = await complete(
        http,
        pair.engine(PRODUCER).url,
        PROMPTS[0],
        max_tokens=1,
        request_id="hybrid-params",
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    payload = KVChecksumPayload.from_bytes(base64.b64decode(params["kv_checksums"]))
    assert payload.num_tokens == params["remote_num_tokens"]
    # The state group: one value (the running state), span 1; the attention
    # group: a value per block.
    spans = sorted(
        (span, len(values)) for _, span, _, values in payload.groups.values()
    )
    ((state_span, states), (block, blocks)) = spans
    assert (state_span, states) == (1, 1), spans
    assert blocks == -(-payload.num_tokens // block), spans


async def test_a_corrupted_state_is_caught_and_retried_and_clean_loads_verify(
    http: aiohttp.ClientSession, pair: Servers
) -> None:
    stage = await through_proxy_as_alone(
        http, pair, PROMPTS, MAX_TOKENS, "hybrid-retry"
    )
    # Each request's first load had its state corrupted; its retry, a clean
    # load, verified (both groups compared) and answered as one instance.
    assert_caught_and_retried(stage, len(PROMPTS))
    consumer = pair.engine(CONSUMER)
    # Only states were corrupted: layer 0 is the Mamba2 mixer.
    assert consumer.log_count("layer model.layers.0.mixer") >= stage.corrupted
