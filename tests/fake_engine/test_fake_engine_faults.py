"""Faults in KV transfers: every kind of corruption, on either side, is caught
by engine_patch's checksums and fails the request (fail-closed, policy
fail) or is recomputed (policy recompute); without checksums the decode
answers 200 with other text — the failure KVGuard exists to stop. Hangs,
slow transfers, expired leases and unverifiable loads behave as vLLM's."""

from __future__ import annotations

import asyncio
import base64
import enum

import aiohttp
import pytest
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    chat_body,
    completion_body,
    metric,
    pd,
    post,
    prefill,
    stream,
    text_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_engine.config import (
    FaultConfig,
    FaultKind,
    FaultSide,
    KVLoadFailurePolicy,
    Role,
)
from fake_engine.testing import EngineSpec, fake_engines

CORRUPTIONS = [kind for kind in FaultKind if kind.corrupts]
FAIL = KVLoadFailurePolicy.FAIL
RECOMPUTE = KVLoadFailurePolicy.RECOMPUTE


def pd_specs(
    fault: FaultConfig,
    *,
    checksums: bool = True,
    fail_closed: bool = True,
    policy: KVLoadFailurePolicy = FAIL,
    lease_s: float = 30.0,
) -> tuple[EngineSpec, EngineSpec, EngineSpec]:
    """A prefill (TP 2) and a decode (block size 32), the fault on its side,
    and a monolithic engine."""
    on_producer = fault.side is FaultSide.PRODUCER
    return (
        EngineSpec(
            role=Role.PRODUCER,
            tp_size=2,
            kv_checksums=checksums,
            fault=fault if on_producer else FaultConfig(),
            lease_s=lease_s,
        ),
        EngineSpec(
            role=Role.CONSUMER,
            block_size=32,
            kv_checksums=checksums,
            fail_closed=fail_closed,
            kv_load_failure_policy=policy,
            fault=FaultConfig() if on_producer else fault,
        ),
        EngineSpec(),
    )


async def warm_up(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """An earlier request on each engine, whose freed blocks stale KV comes from."""
    body = completion_body(prompt="an earlier request " * 4, max_tokens=2)
    for url in urls:
        assert (await post(session, url + COMPLETIONS, body))[0] == 200


@pytest.mark.parametrize("side", list(FaultSide))
@pytest.mark.parametrize("kind", CORRUPTIONS)
async def test_corrupted_load_fails_the_request_under_fail_closed(
    session: aiohttp.ClientSession, kind: FaultKind, side: FaultSide
) -> None:
    async with fake_engines(*pd_specs(FaultConfig(kind, side))) as urls:
        await warm_up(session, urls[:2])
        status, answer = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        assert status == 500
        error = answer["error"]
        assert "KV checksum mismatch" in error["message"]
        assert "does not match the producer's checksums" in error["message"]
        assert (error["type"], error["code"]) == ("InternalServerError", 500)
        assert await metric(session, urls[1], "kvguard_kv_checksum_mismatch_total") == 1
        assert await metric(session, urls[1], "kvguard_kv_load_failures_total") == 1
        engine = urls[0] if side is FaultSide.PRODUCER else urls[1]
        injected = await metric(
            session, engine, "kvguard_kv_faults_injected_total", fault=kind, side=side
        )
        assert injected == 1
        # The engine keeps serving.
        assert (await post(session, urls[1] + COMPLETIONS, completion_body()))[0] == 200


@pytest.mark.parametrize("side", list(FaultSide))
@pytest.mark.parametrize("kind", CORRUPTIONS)
async def test_corrupted_load_is_recomputed_and_answered_correctly(
    session: aiohttp.ClientSession, kind: FaultKind, side: FaultSide
) -> None:
    specs = pd_specs(FaultConfig(kind, side), policy=RECOMPUTE)
    async with fake_engines(*specs) as urls:
        await warm_up(session, urls[:2])
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        status, answer = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        assert status == 200
        assert text_of(answer) == text_of(alone)
        assert await metric(session, urls[1], "kvguard_kv_checksum_mismatch_total") == 1
        assert await metric(session, urls[1], "kvguard_kv_load_failures_total") == 1


@pytest.mark.parametrize("side", list(FaultSide))
@pytest.mark.parametrize("kind", CORRUPTIONS)
async def test_without_checksums_corrupted_kv_answers_200_with_other_text(
    session: aiohttp.ClientSession, kind: FaultKind, side: FaultSide
) -> None:
    specs = pd_specs(FaultConfig(kind, side), checksums=False)
    async with fake_engines(*specs) as urls:
        await warm_up(session, urls[:2])
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        status, answer = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        # The silent failure: a 200 whose text the corrupted KV changed.
        assert status == 200
        assert text_of(answer) != text_of(alone)


async def test_fail_open_serves_corrupted_kv_and_counts_the_mismatch(
    session: aiohttp.ClientSession,
) -> None:
    specs = pd_specs(FaultConfig(FaultKind.BITFLIP), fail_closed=False)
    async with fake_engines(*specs) as urls:
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        status, answer = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        assert status == 200
        assert text_of(answer) != text_of(alone)
        assert await metric(session, urls[1], "kvguard_kv_checksum_mismatch_total") == 1
        assert await metric(session, urls[1], "kvguard_kv_load_failures_total") == 0


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_failed_load_in_a_stream_is_vllms_error_event(
    session: aiohttp.ClientSession, path: str
) -> None:
    body_of = completion_body if path == COMPLETIONS else chat_body
    async with fake_engines(*pd_specs(FaultConfig(FaultKind.ZERO))) as urls:
        params = await prefill(session, urls[0], path, body_of())
        body = {**body_of(stream=True), "kv_transfer_params": params}
        status, events = await stream(session, urls[1] + path, body)
    assert status == 200
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "KV checksum mismatch" in error["message"]
    assert error["code"] == 500
    # Chat sends the role before learning of the failure, as vLLM does.
    before = events[:-2]
    if path == CHAT:
        assert [e["choices"][0]["delta"] for e in before] == [
            {"role": "assistant", "content": ""}
        ]
    else:
        assert before == []


async def test_fault_count_limits_the_faulty_transfers(
    session: aiohttp.ClientSession,
) -> None:
    specs = pd_specs(FaultConfig(FaultKind.BITFLIP, count=1))
    async with fake_engines(*specs) as urls:
        first, _ = await pd(session, urls[0], urls[1], COMPLETIONS, completion_body())
        second, _ = await pd(session, urls[0], urls[1], COMPLETIONS, completion_body())
        assert (first, second) == (500, 200)


async def test_fault_rate_zero_injects_nothing(session: aiohttp.ClientSession) -> None:
    specs = pd_specs(FaultConfig(FaultKind.BITFLIP, rate=0.0))
    async with fake_engines(*specs) as urls:
        for _ in range(3):
            status, _ = await pd(
                session, urls[0], urls[1], COMPLETIONS, completion_body()
            )
            assert status == 200


async def test_faults_set_at_run_time_through_the_admin_route(
    session: aiohttp.ClientSession,
) -> None:
    producer = EngineSpec(role=Role.PRODUCER, enable_fault_admin=True)
    consumer = EngineSpec(role=Role.CONSUMER, fail_closed=True)
    async with fake_engines(producer, consumer) as urls:
        assert (await pd(session, urls[0], urls[1], COMPLETIONS, completion_body()))[
            0
        ] == 200
        status, state = await post(
            session, urls[0] + "/kvguard/faults", {"fault": "swap", "side": "producer"}
        )
        assert status == 200 and state["fault"] == "swap"
        assert (await pd(session, urls[0], urls[1], COMPLETIONS, completion_body()))[
            0
        ] == 500
        status, state = await post(
            session, urls[0] + "/kvguard/faults", {"fault": "none"}
        )
        assert status == 200 and state["injected"] == {"swap/producer": 1}
        assert (await pd(session, urls[0], urls[1], COMPLETIONS, completion_body()))[
            0
        ] == 200


@pytest.mark.parametrize("side", list(FaultSide))
async def test_hung_transfer_waits_until_aborted(
    session: aiohttp.ClientSession, side: FaultSide
) -> None:
    async with fake_engines(*pd_specs(FaultConfig(FaultKind.HANG, side))) as urls:
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        body = {**completion_body(), "kv_transfer_params": params}
        decode = asyncio.create_task(
            post(session, urls[1] + COMPLETIONS, body, {"X-Request-Id": "stuck"})
        )
        done, _ = await asyncio.wait({decode}, timeout=0.3)
        assert not done
        assert await metric(session, urls[1], "vllm:num_requests_waiting") == 1
        status, _ = await post(
            session,
            urls[1] + "/inference/v1/abort_requests",
            {"request_ids": ["stuck"]},
        )
        assert status == 200
        status, answer = await asyncio.wait_for(decode, 5)
        assert status == 200
        assert answer["choices"][0]["finish_reason"] == "abort"
        assert await metric(session, urls[1], "kvguard_requests_aborted_total") == 1
        assert await metric(session, urls[1], "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("side", list(FaultSide))
async def test_slow_transfer_answers_correctly_later(
    session: aiohttp.ClientSession, side: FaultSide
) -> None:
    specs = pd_specs(FaultConfig(FaultKind.SLOW, side, delay_s=0.3))
    async with fake_engines(*specs) as urls:
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, answer = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        assert loop.time() - started >= 0.3
        assert status == 200
        assert text_of(answer) == text_of(alone)


@pytest.mark.parametrize("policy", list(KVLoadFailurePolicy))
async def test_load_after_the_lease_expired_follows_the_failure_policy(
    session: aiohttp.ClientSession, policy: KVLoadFailurePolicy
) -> None:
    specs = pd_specs(FaultConfig(), policy=policy, lease_s=0.1)
    async with fake_engines(*specs) as urls:
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        await asyncio.sleep(0.4)
        body = {**completion_body(), "kv_transfer_params": params}
        status, answer = await post(session, urls[1] + COMPLETIONS, body)
        if policy is FAIL:
            assert status == 500
            assert "KV transfer failed" in answer["error"]["message"]
            assert "404" in answer["error"]["message"]
        else:
            assert status == 200
            assert text_of(answer) == text_of(alone)
        assert await metric(session, urls[1], "kvguard_kv_load_failures_total") == 1


@pytest.mark.parametrize("fail_closed", [True, False])
async def test_load_without_producer_checksums_is_unverified(
    session: aiohttp.ClientSession, fail_closed: bool
) -> None:
    producer = EngineSpec(role=Role.PRODUCER, kv_checksums=False)
    consumer = EngineSpec(role=Role.CONSUMER, fail_closed=fail_closed)
    async with fake_engines(producer, consumer, EngineSpec()) as urls:
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        status, answer = await pd(
            session, urls[0], urls[1], COMPLETIONS, completion_body()
        )
        reason = "the producer sent no checksums"
        if fail_closed:
            assert status == 500
            assert "KV checksum mismatch" in answer["error"]["message"]
            assert reason in answer["error"]["message"]
        else:
            assert status == 200
            assert text_of(answer) == text_of(alone)
        unverified = await metric(
            session, urls[1], "kvguard_kv_checksum_unverified_total", reason=reason
        )
        assert unverified == 1


async def test_client_that_gives_up_aborts_its_request(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(*pd_specs(FaultConfig(FaultKind.HANG))) as urls:
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        body = {**completion_body(), "kv_transfer_params": params}
        impatient = aiohttp.ClientTimeout(total=0.3)
        with pytest.raises(asyncio.TimeoutError):
            await session.post(urls[1] + COMPLETIONS, json=body, timeout=impatient)
        for _ in range(40):
            if await metric(session, urls[1], "kvguard_requests_aborted_total") == 1:
                break
            await asyncio.sleep(0.05)
        assert await metric(session, urls[1], "kvguard_requests_aborted_total") == 1
        assert await metric(session, urls[1], "vllm:num_requests_waiting") == 0


@pytest.mark.parametrize("policy", list(KVLoadFailurePolicy))
async def test_load_from_a_stopped_prefill_follows_the_failure_policy(
    session: aiohttp.ClientSession, policy: KVLoadFailurePolicy
) -> None:
    async with fake_engines(*pd_specs(FaultConfig(), policy=policy)) as urls:
        _, alone = await post(session, urls[2] + COMPLETIONS, completion_body())
        params = await prefill(session, urls[0], COMPLETIONS, completion_body())
        await urls.stop(0)
        body = {**completion_body(), "kv_transfer_params": params}
        status, answer = await post(session, urls[1] + COMPLETIONS, body)
        if policy is FAIL:
            assert status == 500
            assert answer["error"]["message"].startswith("KV transfer failed")
            assert "KV checksum mismatch" not in answer["error"]["message"]
        else:
            assert status == 200
            assert text_of(answer) == text_of(alone)


# Any JSON value a field of the producer's params may be replaced with.
_PARAM_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-1, 70_000)
    | st.sampled_from(["", "127.0.0.1", "pull", "push", "AAAA", "====", "x"]),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=8,
)
_PARAM_KEYS = st.sampled_from(
    [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_request_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_num_tokens",
        "tp_size",
        "transfer_mode",
        "kv_checksums",
    ]
)


class _Edit(enum.Enum):
    """A change to a field of the params other than a new value."""

    REMOVE = "remove"
    # The request's own blocks, listed last to first: the producer serves them.
    REVERSE = "reverse"


# Changes to the params: a field replaced or removed, checksums of other
# bytes (base64 of any payload), or the blocks in another order.
_CHANGES = st.lists(
    st.tuples(_PARAM_KEYS, _PARAM_VALUES | st.just(_Edit.REMOVE))
    | st.tuples(
        st.just("kv_checksums"),
        st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
    )
    | st.just(("remote_block_ids", _Edit.REVERSE)),
    min_size=1,
    max_size=3,
)


@pytest.fixture
async def fail_closed_pair():
    """A prefill (TP 2) and a fail-closed decode (block size 32)."""
    specs = (
        EngineSpec(role=Role.PRODUCER, tp_size=2, lease_s=1.0),
        EngineSpec(role=Role.CONSUMER, block_size=32, fail_closed=True),
    )
    async with fake_engines(*specs) as urls:
        yield urls


@settings(
    max_examples=60,
    deadline=None,
    # One pair serves every example: it must keep serving.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(changes=_CHANGES)
async def test_a_fail_closed_decode_given_any_params_never_answers_wrong_text(
    session: aiohttp.ClientSession, fail_closed_pair: list[str], changes: list
) -> None:
    # Either it loads and verifies the producer's KV, or it prefills itself
    # (params vLLM's NIXL cannot use), or it fails in vLLM's error JSON.
    prefill_url, decode_url = fail_closed_pair
    status, clean = await pd(
        session, prefill_url, decode_url, COMPLETIONS, completion_body()
    )
    assert status == 200, clean
    params = await prefill(session, prefill_url, COMPLETIONS, completion_body())
    for key, value in changes:
        if value is _Edit.REMOVE:
            params.pop(key, None)
        elif value is _Edit.REVERSE:
            ids = params.get(key)
            if isinstance(ids, list):
                params[key] = [g[::-1] if isinstance(g, list) else g for g in ids]
        else:
            params[key] = value
    body = {**completion_body(), "kv_transfer_params": params}
    status, answer = await post(session, decode_url + COMPLETIONS, body)
    assert isinstance(answer, dict), answer
    if status == 200:
        assert text_of(answer) == text_of(clean)
    else:
        assert answer["error"]["code"] == status, answer
