"""KVGuard's vLLM plugin in pieces: its configuration, fault injection,
stats and error messages (vLLM imported, no server), and a real server
refusing a bad configuration at startup."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_steps import make_scheduler, vllm_config
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource as VllmSource
from vllm_servers import MIDDLEWARE, WORK_DIR, EngineSpec, StartStalled, VllmServer

from engine_patch.host import CacheHitSource
from engine_patch.vllm import errors
from engine_patch.vllm.config import (
    FaultSettings,
    KVGuardConfigError,
    inner_transfer_config,
    parse_settings,
)
from engine_patch.vllm.connector import INSIDE_MULTI_CONNECTOR, KVGuardConnector
from engine_patch.vllm.fault import flip_bit, flip_state_bit
from engine_patch.vllm.host import ConnectorHooks
from engine_patch.vllm.scheduler import KVGuardScheduler
from engine_patch.vllm.stats import KVGuardConnectorStats, Snapshot, checksum_deltas
from tests.support.ports import free_port

pytestmark = pytest.mark.vllm


def transfer_config(extra: dict[str, Any], **fields: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_connector_module_path="engine_patch.vllm",
        kv_role=fields.pop("kv_role", "kv_consumer"),
        kv_connector_extra_config=extra,
        **fields,
    )


# ---------------------------------------------------------------- config


def test_defaults_wrap_nixl_with_fail_closed_checksums() -> None:
    settings = parse_settings(transfer_config({}))
    assert settings.inner == {"kv_connector": "NixlConnector"}
    assert settings.kv_checksums.enabled
    # Fail-open is an explicit opt-in, for rollouts.
    assert settings.kv_checksums.fail_closed
    # Unset: the worker's device decides (fused on GPUs, eager on CPUs).
    assert settings.kv_checksums.compile is None
    assert settings.fault_injection is None


def test_inner_config_inherits_role_engine_and_failure_policy() -> None:
    outer = transfer_config(
        {"inner": {"kv_connector": "NixlConnector", "kv_port": 9999}},
        kv_role="kv_producer",
        kv_buffer_device="cpu",
        kv_load_failure_policy="recompute",
    )
    inner = inner_transfer_config(outer, parse_settings(outer))
    assert inner.kv_connector == "NixlConnector"
    assert inner.kv_connector_module_path is None
    assert inner.kv_role == "kv_producer"
    assert inner.engine_id == outer.engine_id
    assert inner.kv_buffer_device == "cpu"
    assert inner.kv_load_failure_policy == "recompute"
    assert inner.kv_port == 9999


@pytest.mark.parametrize(
    ("extra", "fault_injection", "message"),
    [
        (
            {"kv_checksums": {"fail_closd": True}},
            False,
            "unknown key kv_checksums.fail_closd (known: enabled, fail_closed, "
            "compile)",
        ),
        ({"checksums": {}}, False, "unknown key checksums"),
        ({"kv_checksums": {"enabled": "maybe"}}, False, "kv_checksums.enabled"),
        # Strict: no word may switch checksums off.
        ({"kv_checksums": {"enabled": "off"}}, False, "kv_checksums.enabled"),
        ({"kv_checksums": {"fail_closed": 0}}, False, "kv_checksums.fail_closed"),
        ({"kv_checksums": {"compile": "auto"}}, False, "kv_checksums.compile"),
        ({"inner": {}}, False, "inner.kv_connector must name the real connector"),
        (
            {"inner": {"kv_connector": "KVGuardConnector"}},
            False,
            "cannot be KVGuardConnector itself",
        ),
        (
            {"fault_injection": {"loads": "all"}},
            False,
            "only read by KVGuardFaultInjectionConnector",
        ),
        ({}, True, "KVGuardFaultInjectionConnector needs fault_injection"),
        (
            {"fault_injection": {"loads": "some"}},
            True,
            "fault_injection.loads: Input should be 'all', 'every_other' or 'first'",
        ),
        (
            {"fault_injection": {"loads": "all"}, "kv_checksums": {"enabled": False}},
            True,
            "fault_injection needs kv_checksums.enabled",
        ),
    ],
)
def test_bad_extra_config_is_a_clear_error(
    extra: dict[str, Any], fault_injection: bool, message: str
) -> None:
    with pytest.raises(KVGuardConfigError) as error:
        parse_settings(transfer_config(extra), fault_injection=fault_injection)
    assert str(error.value).startswith("Invalid KVGuard config in --kv-transfer-config")
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_role", "kv_producer"), ("kv_load_failure_policy", "recompute")],
)
def test_inner_cannot_disagree_with_what_vllms_scheduler_reads(
    field: str, value: str
) -> None:
    outer = transfer_config(
        {"inner": {"kv_connector": "NixlConnector", field: value}},
        kv_role="kv_consumer",
        kv_load_failure_policy="fail",
    )
    with pytest.raises(KVGuardConfigError, match=f"inner.{field} is"):
        inner_transfer_config(outer, parse_settings(outer))
    agreeing = transfer_config(
        {"inner": {"kv_connector": "NixlConnector", field: getattr(outer, field)}},
        kv_role="kv_consumer",
        kv_load_failure_policy="fail",
    )
    inner_transfer_config(agreeing, parse_settings(agreeing))


@pytest.mark.parametrize(
    "field", ["prefill_context_parallel_size", "decode_context_parallel_size"]
)
def test_context_parallelism_is_refused_while_checksums_are_on(field: str) -> None:
    config = vllm_config("kv_consumer")
    setattr(config.parallel_config, field, 2)
    with pytest.raises(KVGuardConfigError, match=f"{field}=2"):
        parse_settings(transfer_config({})).checksum_config(config)
    off = parse_settings(transfer_config({"kv_checksums": {"enabled": False}}))
    assert not off.checksum_config(config).enabled


def test_inner_fields_a_transfer_config_lacks_are_a_clear_error() -> None:
    outer = transfer_config({"inner": {"kv_connector": "NixlConnector", "port": 1}})
    with pytest.raises(KVGuardConfigError, match=r"inner has fields .*: port"):
        inner_transfer_config(outer, parse_settings(outer))


def example_connector(role: str, storage: Path) -> dict[str, Any]:
    """vLLM's ExampleConnector (KV on disk), which lacks the hybrid KV cache
    manager's support."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def test_a_multi_connector_lacking_hybrid_support_gets_the_config_vllm_gives_it(
    tmp_path: Path,
) -> None:
    role = "kv_consumer"
    nixl = {"kv_connector": "NixlConnector", "kv_role": role}
    children = [nixl, example_connector(role, tmp_path)]
    config = vllm_config(
        role,
        inner={
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": children},
        },
    )
    # vLLM sees KVGuard's support and keeps its hybrid KV cache manager on.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    # MultiConnector refused that (an AssertionError) before KVGuard gave it
    # the config vLLM gives it alone: the manager off, which changes nothing
    # for one full-attention group.
    connector = make_scheduler(KVGuardScheduler, config).connector
    assert isinstance(connector, KVGuardConnector)
    inner = connector.inner
    assert isinstance(inner, MultiConnector)
    assert inner._vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False


@pytest.mark.parametrize("kinds", [["sliding_window"], ["sliding_window", "full"]])
def test_an_inner_lacking_hybrid_support_is_refused_where_the_manager_counts(
    tmp_path: Path, kinds: list[str]
) -> None:
    role = "kv_consumer"
    config = vllm_config(role, inner=example_connector(role, tmp_path))
    shape: dict[str, Any] = {
        "block_size": 32,
        "num_kv_heads": 2,
        "head_size": 32,
        "dtype": torch.bfloat16,
    }
    specs = {
        "full": FullAttentionSpec(**shape),
        "sliding_window": SlidingWindowSpec(**shape, sliding_window=64),
    }
    kv_cache_config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], specs[kind])
            for i, kind in enumerate(kinds)
        ],
    )
    with pytest.raises(
        KVGuardConfigError,
        match=r"ExampleConnector does not support the hybrid KV cache manager.*; "
        "set --disable-hybrid-kv-cache-manager",
    ):
        KVGuardConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


def kvguard_inside_multi_connector(role: str, *, enabled: bool) -> dict[str, Any]:
    """A MultiConnector whose first connector is KVGuard (around NIXL): the
    nesting KVGuard's docs warn against."""
    kvguard = {
        "kv_connector": "KVGuardConnector",
        "kv_connector_module_path": "engine_patch.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"kv_checksums": {"enabled": enabled}},
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "connectors": [kvguard, {"kv_connector": "NixlConnector", "kv_role": role}]
        },
    }


def scheduler_with_kvguard_inside(role: str, *, enabled: bool) -> Scheduler:
    """vLLM's own scheduler, which builds the MultiConnector of
    :func:`kvguard_inside_multi_connector`, which builds KVGuard."""
    config = vllm_config(role, connector="NixlConnector")
    config.kv_transfer_config = KVTransferConfig(
        **kvguard_inside_multi_connector(role, enabled=enabled)
    )
    return make_scheduler(Scheduler, config)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kvguard_inside_a_multi_connector_is_refused_while_checksums_are_on(
    role: str,
) -> None:
    with pytest.raises(
        KVGuardConfigError, match="one of a MultiConnector's connectors"
    ):
        scheduler_with_kvguard_inside(role, enabled=True)


def test_kvguard_inside_a_multi_connector_builds_with_checksums_off() -> None:
    connector = scheduler_with_kvguard_inside("kv_consumer", enabled=False).connector
    assert isinstance(connector, MultiConnector)
    assert isinstance(connector.sub_connectors[0], KVGuardConnector)


def bad_configs() -> dict[str, tuple[dict[str, Any], str]]:
    """Per case, a consumer's --kv-transfer-config KVGuard refuses, and what
    its refusal says."""
    misspelt = EngineSpec("consumer").kv_transfer_config()
    misspelt["kv_connector_extra_config"]["kv_checksums"]["fail_closd"] = True
    return {
        "unknown-key": (misspelt, "unknown key kv_checksums.fail_closd"),
        "inside-multi-connector": (
            kvguard_inside_multi_connector("kv_consumer", enabled=True),
            INSIDE_MULTI_CONNECTOR,
        ),
    }


@pytest.mark.parametrize("case", list(bad_configs()))
async def test_a_server_with_a_bad_config_refuses_to_start_and_says_why(
    case: str,
) -> None:
    config, reason = bad_configs()[case]
    server = VllmServer(
        f"bad-config-{case}", free_port(), WORK_DIR / "logs" / f"bad-config-{case}.log"
    )
    server.side_port = free_port()
    server.start(EngineSpec("consumer"), kv_transfer_config=config)
    try:
        try:
            returncode = await server.wait_exit(240)
        except StartStalled:  # before vLLM read the config: once more, as Servers
            await asyncio.to_thread(server.stop)
            server.start(EngineSpec("consumer"), kv_transfer_config=config)
            returncode = await server.wait_exit(240)
    finally:
        await asyncio.to_thread(server.stop)
    assert returncode != 0
    assert (
        f"Invalid KVGuard config in --kv-transfer-config: {reason}"
        in server.log_path.read_text()
    )


# ---------------------------------------------------------------- faults


@pytest.mark.parametrize(
    ("settings", "corrupted"),
    [
        (FaultSettings(loads="all"), [1, 2, 3, 4, 5, 6]),
        (FaultSettings(loads="every_other"), [1, 3, 5]),
        (FaultSettings(loads="first", count=2), [1, 2]),
        (FaultSettings(loads="first", count=0), []),
    ],
)
def test_fault_settings_choose_the_loads_to_corrupt(
    settings: FaultSettings, corrupted: list[int]
) -> None:
    assert [n for n in range(1, 7) if settings.corrupts(n)] == corrupted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_flip_bit_flips_exactly_one_bit_of_the_block(dtype: torch.dtype) -> None:
    # [blocks, heads, tokens, content], strided as vLLM's layouts can be.
    base = torch.randn(4, 8, 2, 32).to(dtype)
    kv = base.permute(0, 2, 1, 3)
    before = kv.clone()
    flip_bit(kv, 2)
    changed = kv.contiguous().view(torch.uint8) != before.contiguous().view(torch.uint8)
    assert changed.sum() == 1
    xor = kv.contiguous().view(torch.uint8) ^ before.contiguous().view(torch.uint8)
    assert int(xor.sum()) == 0x80
    assert changed[2].any()


@pytest.mark.parametrize("shape", [(4, 3), (4, 2, 3), (4, 2, 3, 5)])
def test_flip_state_bit_flips_exactly_one_bit_of_the_blocks_state(
    shape: tuple[int, ...],
) -> None:
    state = torch.randn(shape, dtype=torch.float32)
    before = state.clone()
    flip_state_bit(state, 2)
    flipped = (state.view(torch.int32) ^ before.view(torch.int32)).flatten()
    (position,) = flipped.nonzero().flatten().tolist()
    first = 2 * state[0].numel()  # the first element of block 2's state
    assert position == first
    assert int(flipped[position]) == -(1 << 31)  # the top bit, as int32


# ---------------------------------------------------------------- stats


def _stats(**counts: Any) -> KVGuardConnectorStats:
    stats = KVGuardConnectorStats()
    stats.counts.update(counts)
    return stats


def test_stats_aggregate_counts_reasons_and_inner_stats() -> None:
    nixl = NixlKVConnectorStats()
    nixl.record_failed_transfer()
    first = _stats(verified=2, unverified={"a": 1}, failed_requests={"r1": "m1"})
    first.set_inner("NixlConnector", None, nixl)
    second = _stats(
        verified=1, mismatch=1, unverified={"a": 1, "b": 2}, checksum_bytes=10
    )
    total = first.aggregate(second)
    assert isinstance(total, KVGuardConnectorStats)
    assert total.counts["verified"] == 3
    assert total.counts["mismatch"] == 1
    assert total.counts["unverified"] == {"a": 2, "b": 2}
    assert total.counts["failed_requests"] == {"r1": "m1"}
    assert total.counts["checksum_bytes"] == 10
    assert total.inner is nixl
    assert not total.is_empty()


@pytest.mark.parametrize("first_has_inner", [False, True])
def test_stats_aggregate_the_inner_stats_whichever_side_has_them(
    first_has_inner: bool,
) -> None:
    first, second = _stats(verified=1), _stats(verified=2)
    for stats in (first, second) if first_has_inner else (second,):
        nixl = NixlKVConnectorStats()
        nixl.record_failed_transfer()
        stats.set_inner("NixlConnector", None, nixl)
    total = first.aggregate(second)
    assert isinstance(total, KVGuardConnectorStats)
    assert total.counts["verified"] == 3
    assert isinstance(total.inner, NixlKVConnectorStats)
    assert total.inner.data["num_failed_transfers"] == [1] * (1 + first_has_inner)


def test_stats_survive_serialization_with_the_inner_connectors() -> None:
    nixl = NixlKVConnectorStats()
    nixl.record_failed_handshake()
    stats = _stats(mismatch=1, failed_loads=1)
    stats.set_inner("NixlConnector", None, nixl)
    data = json.loads(json.dumps(stats.to_dict()))
    rebuilt = KVGuardConnectorStats.build(data)
    assert rebuilt.counts["mismatch"] == 1
    assert isinstance(rebuilt.inner, NixlKVConnectorStats)
    assert rebuilt.inner.data["num_failed_handshakes"] == [1]
    reduced = rebuilt.reduce()
    assert reduced["mismatched"] == 1
    assert reduced["loads failed"] == 1


def test_stats_deltas_are_the_outcomes_between_two_snapshots() -> None:
    before = Snapshot(3, 1, 1, {"a": 1, "b": 2}, {"x": 1})
    now = Snapshot(5, 2, 4, {"a": 4, "b": 2, "c": 1}, {"x": 1})
    deltas = checksum_deltas(now, before)
    assert (deltas["verified"], deltas["mismatch"], deltas["sent"]) == (2, 1, 3)
    assert deltas["unverified"] == {"a": 3, "c": 1}
    assert deltas["not_sent"] == {}


def test_stats_without_inner_stats_reduce_and_survive_serialization() -> None:
    stats = _stats(verified=2, checksum_bytes=4000, checksum_seconds=2e-6)
    data = json.loads(json.dumps(stats.to_dict()))
    rebuilt = KVGuardConnectorStats.build(data)
    assert rebuilt.inner is None
    assert rebuilt.reduce() == {
        "KV checksums verified": 2,
        "mismatched": 0,
        "unverified": 0,
        "loads failed": 0,
        "sent": 0,
        "checksum GB/s": 2.0,
    }


def test_empty_inner_stats_add_nothing_to_the_reduced_stats() -> None:
    stats = _stats(verified=1)
    stats.set_inner("NixlConnector", None, NixlKVConnectorStats())
    assert stats.reduce() == _stats(verified=1).reduce()


def test_empty_stats_are_empty() -> None:
    assert KVGuardConnectorStats().is_empty()
    assert KVGuardConnectorStats.build(None).is_empty()


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("engine_id", "client_id"),
    [
        ("cmpl-abc-1-0-1234abcd", "abc-1"),
        ("cmpl-abc-12-1234abcd", "abc"),
        ("chatcmpl-abc-1-1234abcd", "abc-1"),
        ("cmpl-req-retry1-0-0f0f0f0f", "req-retry1"),
        ("something-else", None),
    ],
)
def test_engine_ids_give_back_the_client_request_id(
    engine_id: str, client_id: str | None
) -> None:
    assert errors.client_request_id(engine_id) == client_id


def test_failures_are_found_by_the_client_request_id_only() -> None:
    errors.record_failures({"cmpl-abc-1-0-1234abcd": "KV checksum mismatch: x"})
    assert errors.failure_for("abc-1") == "KV checksum mismatch: x"
    assert errors.failure_for("abc") is None
    assert errors.failure_for("bc-1") is None


@pytest.fixture
def no_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh memory of failed loads, for tests that fill or age it."""
    monkeypatch.setattr(errors, "_failures", OrderedDict())


@pytest.mark.usefixtures("no_failures")
def test_the_newest_4096_failures_are_remembered() -> None:
    errors.record_failures(
        {f"cmpl-cap-{i}-0-deadbeef": f"mismatch {i}" for i in range(4097)}
    )
    assert errors.failure_for("cap-0") is None
    assert errors.failure_for("cap-1") == "mismatch 1"
    assert errors.failure_for("cap-4096") == "mismatch 4096"


@pytest.mark.usefixtures("no_failures")
def test_a_failure_is_forgotten_after_five_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = time.monotonic()
    monkeypatch.setattr(errors.time, "monotonic", lambda: now)
    errors.record_failures({"cmpl-old-1-0-deadbeef": "KV checksum mismatch: o"})
    monkeypatch.setattr(errors.time, "monotonic", lambda: now + 299.0)
    assert errors.failure_for("old-1") == "KV checksum mismatch: o"
    monkeypatch.setattr(errors.time, "monotonic", lambda: now + 301.0)
    assert errors.failure_for("old-1") is None


def test_rewrite_replaces_the_generic_message_in_json_and_sse() -> None:
    body = json.dumps({"error": {"message": "Internal server error", "code": 500}})
    rewritten = json.loads(errors.rewrite(body.encode(), "KV checksum mismatch: y"))
    assert rewritten["error"]["message"] == "KV checksum mismatch: y"
    event = b'data: {"error": {"message": "Internal server error"}}\n\n'
    assert b"KV checksum mismatch: y" in errors.rewrite(
        event, "KV checksum mismatch: y"
    )


def _asgi_app(status: int, chunks: list[bytes], sized: bool) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"application/json")]
        if sized:
            headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
        await send(
            {"type": "http.response.start", "status": status, "headers": headers}
        )
        for i, chunk in enumerate(chunks):
            more = i < len(chunks) - 1
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

    return app


async def _sent(app: Any, request_id: str | None) -> list[dict[str, Any]]:
    """The ASGI messages the middleware around ``app`` sends for one request."""
    sent: list[dict[str, Any]] = []
    headers = [(b"x-request-id", request_id.encode())] if request_id else []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": headers}
    await errors.KVChecksumErrorMiddleware(app)(scope, receive, send)
    return sent


async def _call(app: Any, request_id: str | None) -> tuple[dict[str, Any], bytes]:
    start, *bodies = await _sent(app, request_id)
    return start, b"".join(m.get("body", b"") for m in bodies)


GENERIC = json.dumps({"error": {"message": "Internal server error"}}).encode()


async def test_middleware_puts_the_reason_into_a_failed_requests_500() -> None:
    errors.record_failures({"cmpl-req-7-0-deadbeef": "KV checksum mismatch: z"})
    app = _asgi_app(500, [GENERIC[:10], GENERIC[10:]], sized=True)
    start, body = await _call(app, "req-7")
    assert json.loads(body)["error"]["message"] == "KV checksum mismatch: z"
    # The app's headers, with one content-length: the new body's.
    assert start["headers"] == [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]


async def test_middleware_rewrites_a_streamed_error_event() -> None:
    errors.record_failures({"cmpl-req-8-0-deadbeef": "KV checksum mismatch: s"})
    event = b"data: " + GENERIC + b"\n\n"
    _, body = await _call(_asgi_app(200, [event, b"data: [DONE]\n\n"], False), "req-8")
    assert b"KV checksum mismatch: s" in body
    assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("request_id", [None, "req-9"])
async def test_middleware_leaves_other_errors_alone(request_id: str | None) -> None:
    errors.record_failures({"cmpl-req-7-0-deadbeef": "KV checksum mismatch: z"})
    start, body = await _call(_asgi_app(500, [GENERIC], sized=True), request_id)
    assert body == GENERIC
    assert start["status"] == 500


async def test_middleware_passes_other_responses_through_chunk_by_chunk() -> None:
    errors.record_failures({"cmpl-req-6-0-deadbeef": "KV checksum mismatch: p"})
    chunks = [b'{"choices": ', b"[]}"]
    sent = await _sent(_asgi_app(200, chunks, sized=True), "req-6")
    assert [m.get("body") for m in sent] == [None, *chunks]
    assert dict(sent[0]["headers"])[b"content-length"] == b"15"


def test_middleware_is_what_the_test_servers_load() -> None:
    module, name = MIDDLEWARE.rsplit(".", 1)
    assert getattr(errors, name) is errors.KVChecksumErrorMiddleware
    assert module == errors.__name__


def _prom(registry: CollectorRegistry) -> KVConnectorProm:
    """vLLM's per-connector Prometheus metrics of a KVGuard consumer, in
    ``registry``."""

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    return Prom(vllm_config("kv_consumer"), ["engine"], {0: ["0"]})


@pytest.mark.usefixtures("no_failures")
def test_prometheus_counts_kvguards_outcomes_and_the_inner_connectors() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    nixl = NixlKVConnectorStats()
    nixl.record_failed_transfer()
    stats = _stats(
        verified=2,
        mismatch=1,
        checksum_bytes=4096,
        unverified={"the producer sent no checksums": 3},
        failed_requests={"cmpl-prom-1-0-deadbeef": "KV checksum mismatch: m"},
    )
    stats.set_inner("NixlConnector", None, nixl)
    prom.observe(stats.to_dict(), 0)
    value = registry.get_sample_value
    assert value("kvguard_kv_checksum_verified_total", {"engine": "0"}) == 2
    assert value("kvguard_kv_checksum_mismatch_total", {"engine": "0"}) == 1
    assert value("kvguard_kv_checksum_bytes_total", {"engine": "0"}) == 4096
    assert value("kvguard_kv_checksum_sent_total", {"engine": "0"}) == 0
    reason = {"engine": "0", "reason": "the producer sent no checksums"}
    assert value("kvguard_kv_checksum_unverified_total", reason) == 3
    assert value("vllm:nixl_num_failed_transfers_total", {"engine": "0"}) == 1
    # The API server's middleware now knows why that request failed.
    assert errors.failure_for("prom-1") == "KV checksum mismatch: m"
    # An interval without the inner connector's stats.
    prom.observe(_stats(verified=1).to_dict(), 0)
    assert value("kvguard_kv_checksum_verified_total", {"engine": "0"}) == 3
    assert value("vllm:nixl_num_failed_transfers_total", {"engine": "0"}) == 1


@pytest.mark.parametrize(
    ("vllm_sources", "sources"),
    [
        (
            {VllmSource.HOST: 10, VllmSource.DISK: 6, VllmSource.P2P: 0},
            {CacheHitSource.OFFLOAD: 16},
        ),
        (
            {VllmSource.P2P: 4, VllmSource.EXTERNAL_UNSPECIFIED: 5},
            {CacheHitSource.P2P: 9},
        ),
    ],
)
def test_the_inner_connectors_cache_tiers_add_up_as_kvguards_sources(
    vllm_sources: dict[VllmSource, int], sources: dict[CacheHitSource, int]
) -> None:
    inner = SimpleNamespace(get_external_cache_hit_sources=lambda r, n: vllm_sources)
    hooks = ConnectorHooks(inner)
    assert hooks.get_external_cache_hit_sources(object(), 16) == sources
