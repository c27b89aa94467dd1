"""KVGuard in real vLLM 0.32 (CPU): two instances doing P/D over
NixlConnector, the KVGuard proxy in front, clean and corrupted loads.

The tests share one producer and one consumer instance and restart only the
one whose configuration changes, so they run in this file's order.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp
import pytest
from vllm_servers import (
    EngineSpec,
    Pair,
    complete,
    deltas,
    error_message,
    metrics,
    prompts,
    stream_text,
    text_of,
)

from engine_patch.payload import KVChecksumPayload

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(900),
]

KVGUARD_PRODUCER = EngineSpec("producer")
KVGUARD_CONSUMER = EngineSpec("consumer")  # fail-closed, policy "fail"
PLAIN_PRODUCER = EngineSpec("producer", connector="nixl")

PROMPTS = prompts(20)
MAX_TOKENS = 12
NO_CHECKSUMS = "the producer sent no checksums"

# The single-instance answers, by prompt: computed once, locally on the
# producer (a plain request prefills and decodes on one instance).
_references: dict[str, str] = {}


async def references(http: aiohttp.ClientSession, pair: Pair) -> dict[str, str]:
    if not _references:
        texts = {}
        for prompt in PROMPTS:
            status, answer = await complete(
                http, pair.producer.url, prompt, max_tokens=MAX_TOKENS
            )
            assert status == 200, answer
            texts[prompt] = text_of(answer)
        # Not all the same text: the test would not see wrong KV otherwise.
        assert len(set(texts.values())) > len(PROMPTS) // 2
        _references.update(texts)
    return _references


async def prefill(
    http: aiohttp.ClientSession, pair: Pair, prompt: str, request_id: str
) -> dict[str, Any]:
    """A prefill as the proxy sends it; its kv_transfer_params."""
    status, answer = await complete(
        http,
        pair.producer.url,
        prompt,
        max_tokens=1,
        request_id=request_id,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return dict(params)


async def through_proxy(
    http: aiohttp.ClientSession, pair: Pair, prompt: str, request_id: str
) -> tuple[int, Any]:
    return await complete(
        http, pair.proxy.url, prompt, max_tokens=MAX_TOKENS, request_id=request_id
    )


async def snapshot(http: aiohttp.ClientSession, pair: Pair) -> dict[str, Any]:
    return {
        "producer": await metrics(http, pair.producer.url),
        "consumer": await metrics(http, pair.consumer.url),
        "proxy": await metrics(http, pair.proxy.url),
    }


async def changes(
    http: aiohttp.ClientSession, pair: Pair, before: dict[str, Any]
) -> dict[str, dict[str, float]]:
    after = await snapshot(http, pair)
    return {name: deltas(after[name], before[name]) for name in after}


def unverified(samples: dict[str, float]) -> float:
    return samples.get("kvguard_kv_checksum_unverified_total", 0.0)


async def test_loads_from_a_producer_without_kvguard_are_unverified_and_fail(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    await pair.use(PLAIN_PRODUCER, KVGUARD_CONSUMER)
    before = await snapshot(http, pair)
    for i, prompt in enumerate(PROMPTS[:3]):
        params = await prefill(http, pair, prompt, f"plain-{i}")
        assert "kv_checksums" not in params
        status, answer = await complete(
            http,
            pair.consumer.url,
            prompt,
            max_tokens=MAX_TOKENS,
            request_id=f"plain-{i}",
            kv_transfer_params=params,
        )
        assert status == 500, answer
        message = error_message(answer)
        assert "KV checksum mismatch" in message
        assert f"could not be verified: {NO_CHECKSUMS}" in message
    consumer = (await changes(http, pair, before))["consumer"]
    reason = f"kvguard_kv_checksum_unverified_total{{reason={NO_CHECKSUMS}}}"
    assert consumer.get(reason) == 3
    assert consumer.get("kvguard_kv_load_failures_total") == 3
    assert consumer.get("kvguard_kv_checksum_verified_total", 0) == 0


async def test_prefill_returns_kv_checksums_in_kv_transfer_params(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    await pair.use(KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    params = await prefill(http, pair, PROMPTS[0], "params-0")
    payload = KVChecksumPayload.from_bytes(base64.b64decode(params["kv_checksums"]))
    assert payload.tp_size == 1
    assert payload.num_tokens == params["remote_num_tokens"]
    # One KV cache group (Llama), one checksum per transferred block.
    ((fingerprint, block_size, start, values),) = payload.groups.values()
    assert (block_size, start) == (32, 0)
    assert len(values) == len(params["remote_block_ids"][0])
    assert fingerprint != 0 and all(values)


async def test_clean_loads_through_the_proxy_verify_and_match_a_single_instance(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    await pair.use(KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    expected = await references(http, pair)
    before = await snapshot(http, pair)
    limit = asyncio.Semaphore(4)

    async def one(i: int, prompt: str) -> None:
        async with limit:
            status, answer = await through_proxy(http, pair, prompt, f"clean-{i}")
        assert status == 200, answer
        assert text_of(answer) == expected[prompt], prompt

    await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(PROMPTS)))
    change = await changes(http, pair, before)
    consumer, producer, proxy = change["consumer"], change["producer"], change["proxy"]
    assert consumer.get("kvguard_kv_checksum_verified_total") == len(PROMPTS)
    # Each load waited for its verification before vLLM saw it finish.
    assert consumer.get("kvguard_kv_loads_held_total") == len(PROMPTS)
    assert consumer.get("kvguard_kv_checksum_mismatch_total", 0) == 0
    assert unverified(consumer) == 0
    assert consumer.get("kvguard_kv_load_failures_total", 0) == 0
    assert consumer.get("kvguard_kv_checksum_bytes_total", 0) > 0
    assert producer.get("kvguard_kv_checksum_sent_total") == len(PROMPTS)
    assert proxy.get("kvguard_proxy_retries_total", 0) == 0


async def test_corrupted_loads_fail_open_are_counted_and_answered(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    consumer_spec = EngineSpec(
        "consumer", "faults", fail_closed=False, faults=(("loads", "all"),)
    )
    await pair.use(KVGUARD_PRODUCER, consumer_spec)
    before = await snapshot(http, pair)
    for i, prompt in enumerate(PROMPTS[:6]):
        status, answer = await through_proxy(http, pair, prompt, f"open-{i}")
        assert status == 200, answer
        assert text_of(answer)
    change = await changes(http, pair, before)
    consumer, proxy = change["consumer"], change["proxy"]
    assert consumer.get("kvguard_kv_checksum_mismatch_total") == 6
    assert consumer.get("kvguard_kv_checksum_verified_total", 0) == 0
    assert consumer.get("kvguard_kv_load_failures_total", 0) == 0
    # Fail-open does not hold loads for their verdicts.
    assert consumer.get("kvguard_kv_loads_held_total", 0) == 0
    assert proxy.get("kvguard_proxy_retries_total", 0) == 0


async def test_corrupted_load_is_retried_on_another_prefill_and_answers_clean_text(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    # Every other load corrupted: each request's first attempt fails, its
    # retry (a new prefill and load) is clean.
    consumer_spec = EngineSpec(
        "consumer", "faults", policy="fail", faults=(("loads", "every_other"),)
    )
    await pair.use(KVGUARD_PRODUCER, consumer_spec)
    expected = await references(http, pair)
    before = await snapshot(http, pair)
    for i, prompt in enumerate(PROMPTS[:6]):
        status, answer = await through_proxy(http, pair, prompt, f"retry-{i}")
        assert status == 200, answer
        assert text_of(answer) == expected[prompt]
    # Streamed, the retry happens before the client's first byte too.
    prompt = PROMPTS[6]
    text = await stream_text(
        http, pair.proxy.url, prompt, max_tokens=MAX_TOKENS, request_id="retry-stream"
    )
    assert text == expected[prompt]
    change = await changes(http, pair, before)
    consumer, proxy = change["consumer"], change["proxy"]
    assert consumer.get("kvguard_kv_checksum_mismatch_total") == 7
    assert consumer.get("kvguard_kv_load_failures_total") == 7
    assert consumer.get("kvguard_kv_checksum_verified_total") == 7
    assert unverified(consumer) == 0
    assert proxy.get("kvguard_proxy_retries_total{reason=kv_integrity}") == 7
    assert proxy.get("kvguard_proxy_kv_integrity_failures_total") == 7


async def test_corrupted_loads_recompute_locally_and_answer_clean_text(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    consumer_spec = EngineSpec(
        "consumer", "faults", policy="recompute", faults=(("loads", "all"),)
    )
    await pair.use(KVGUARD_PRODUCER, consumer_spec)
    expected = await references(http, pair)
    before = await snapshot(http, pair)
    for i, prompt in enumerate(PROMPTS[:6]):
        status, answer = await through_proxy(http, pair, prompt, f"recompute-{i}")
        assert status == 200, answer
        assert text_of(answer) == expected[prompt]
    change = await changes(http, pair, before)
    consumer, proxy = change["consumer"], change["proxy"]
    assert consumer.get("kvguard_kv_checksum_mismatch_total") == 6
    assert consumer.get("kvguard_kv_load_failures_total") == 6
    assert proxy.get("kvguard_proxy_retries_total", 0) == 0
