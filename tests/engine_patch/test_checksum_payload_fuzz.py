"""Malformed checksum payloads: decoding raises ValueError and nothing else,
and the scheduler turns any payload, however odd, into an outcome (verified,
mismatch or unverified), never an exception."""

from __future__ import annotations

import base64
import re
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_host_fakes import (
    FakeBlocks,
    FakeConnectorOutput,
    FakeWorkers,
    consumer_request,
    scheduled_values,
    token_values,
)
from scheduler_harness import make_scheduler

from engine_patch.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)
from engine_patch.payload import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumPayload,
    decode_base64,
    encode_base64,
)
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.verify import UnverifiedReason

U64 = st.integers(0, 2**64 - 1)
FINGERPRINTS = {0: 0xF00D, 1: 0xBEEF, 2: 0xCAFE}

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def decodes_or_value_error(data: bytes) -> KVChecksumPayload | None:
    """The payload, or None if ``from_bytes`` raised ValueError; any other
    exception fails the test."""
    try:
        return KVChecksumPayload.from_bytes(data)
    except ValueError:
        return None


valid_payloads = st.builds(
    KVChecksumPayload,
    tp_size=st.integers(1, 2**64 - 1),
    num_tokens=U64,
    groups=st.dictionaries(
        st.integers(-(2**63), 2**64 - 1),
        st.tuples(
            U64,
            st.integers(1, 2**64 - 1),
            U64,
            st.lists(U64, max_size=8).map(lambda v: np.array(v, dtype=np.uint64)),
        ),
        max_size=4,
    ),
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_value_error(data: bytes) -> None:
    decodes_or_value_error(data)


@FUZZ
@given(valid_payloads, st.data())
def test_every_truncation_of_a_payload_raises_value_error(
    payload: KVChecksumPayload, data: st.DataObject
) -> None:
    encoded = payload.to_bytes()
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ValueError, match="invalid KV checksums"):
        KVChecksumPayload.from_bytes(encoded[:cut])


@FUZZ
@given(valid_payloads)
def test_a_valid_payload_round_trips(payload: KVChecksumPayload) -> None:
    decoded = KVChecksumPayload.from_bytes(payload.to_bytes())
    assert (decoded.tp_size, decoded.num_tokens) == (
        payload.tp_size,
        payload.num_tokens,
    )
    assert decoded.groups.keys() == payload.groups.keys()
    for group_id, (fp, bs, start, values) in payload.groups.items():
        got_fp, got_bs, got_start, got_values = decoded.groups[group_id]
        assert (got_fp, got_bs, got_start) == (fp, bs, start)
        np.testing.assert_array_equal(got_values, values)
        # The host's own uint64: the scheduler compares checksums as bytes.
        assert got_values.dtype == np.dtype(np.uint64)


@FUZZ
@given(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != 1), valid_payloads)
def test_another_version_raises_value_error(
    version: int, payload: KVChecksumPayload
) -> None:
    _, *rest = msgspec.msgpack.decode(payload.to_bytes())
    with pytest.raises(ValueError, match="invalid KV checksums"):
        KVChecksumPayload.from_bytes(msgspec.msgpack.encode([version, *rest]))


@FUZZ
@given(msgpack_values)
def test_any_msgpack_value_decodes_or_raises_value_error(value: Any) -> None:
    decodes_or_value_error(msgspec.msgpack.encode(value))


def _replace(obj: Any, path: list[int], value: Any) -> Any:
    if not path:
        return value
    obj = list(obj)
    obj[path[0]] = _replace(obj[path[0]], path[1:], value)
    return obj


@FUZZ
@given(valid_payloads.filter(lambda p: p.groups), st.data())
def test_a_field_of_the_wrong_type_raises_value_error(
    payload: KVChecksumPayload, data: st.DataObject
) -> None:
    message = msgspec.msgpack.decode(payload.to_bytes())
    # A top-level field, or one of the first group's.
    path = data.draw(st.sampled_from([[1], [2], [3], *([3, 0, i] for i in range(5))]))
    wrong = data.draw(
        st.sampled_from([None, "16", 1.5, [1], {"a": 1}, b"x" if path[-1] != 4 else 7])
    )
    with pytest.raises(ValueError, match="invalid KV checksums"):
        KVChecksumPayload.from_bytes(
            msgspec.msgpack.encode(_replace(message, path, wrong))
        )


@FUZZ
@given(valid_payloads.filter(lambda p: p.groups), st.data())
def test_a_payload_naming_a_group_twice_raises_value_error(
    payload: KVChecksumPayload, data: st.DataObject
) -> None:
    version, tp_size, num_tokens, groups = msgspec.msgpack.decode(payload.to_bytes())
    twice = data.draw(st.sampled_from(groups))
    at = data.draw(st.integers(0, len(groups)))
    groups = [*groups[:at], twice, *groups[at:]]
    with pytest.raises(ValueError, match="a group twice"):
        KVChecksumPayload.from_bytes(
            msgspec.msgpack.encode([version, tp_size, num_tokens, groups])
        )


@FUZZ
@given(valid_payloads.filter(lambda p: p.groups), st.data())
def test_a_field_out_of_its_range_raises_value_error(
    payload: KVChecksumPayload, data: st.DataObject
) -> None:
    message = msgspec.msgpack.decode(payload.to_bytes())
    # TP size, token count; the first group's fingerprint, span, first span.
    out_of_range = [
        ([1], 0),
        ([1], -2),
        ([2], -1),
        ([3, 0, 1], -1),
        ([3, 0, 2], 0),
        ([3, 0, 3], -1),
    ]
    path, wrong = data.draw(st.sampled_from(out_of_range))
    with pytest.raises(ValueError, match="invalid KV checksums: bad"):
        KVChecksumPayload.from_bytes(
            msgspec.msgpack.encode(_replace(message, path, wrong))
        )


# --- The scheduler never raises on a payload ----------------------------------

CONFIG = KVCacheConfig(
    [
        KVCacheGroup(FullAttentionSpec(16)),
        KVCacheGroup(SlidingWindowSpec(32, sliding_window=48)),
        KVCacheGroup(MambaSpec(block_size=64)),
    ]
)


def load(
    params: dict[str, Any], num_tokens: int, num_local_tokens: int
) -> KVChecksumScheduler:
    """A consumer (TP 2) loads a request with these params; its workers
    report random KV."""
    workers = FakeWorkers(tp=2, fingerprints=FINGERPRINTS)
    scheduler = make_scheduler(CONFIG, tp=2)
    req = consumer_request("c", num_tokens, params)
    scheduler.on_new_request(req)
    req.num_computed_tokens = num_tokens
    n16, n32 = -(-num_tokens // 16), -(-num_tokens // 32)
    scheduler.add_recv(
        req,
        FakeBlocks.of(list(range(1, n16 + 1)), list(range(1, n32 + 1)), [None, 5]),
        num_local_tokens,
    )
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    rng = np.random.default_rng(num_tokens)
    blocks = scheduled.reqs_to_recv["c"]
    tokens = {g: token_values(rng, max(num_tokens, 1)) for g in range(3)}
    values = scheduled_values(blocks, tokens, CONFIG)
    failed = scheduler.update_from_output(
        FakeConnectorOutput(workers.report("c", values), {"c"}), set()
    )
    stats = scheduler.stats
    outcomes = stats.verified + stats.mismatch + (1 if stats.unverified else 0)
    assert outcomes == 1
    assert failed == ({"c"} if not stats.verified else set())
    return scheduler


@FUZZ
@given(st.binary(max_size=200))
def test_base64_is_the_standard_padded_encoding_and_round_trips(data: bytes) -> None:
    encoded = encode_base64(data)
    assert encoded == base64.b64encode(data).decode("ascii")
    assert decode_base64(encoded) == data


BASE64_TEXT = st.text(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n\xe9",
    max_size=24,
)


# Padded base64: whole groups of four, the standard alphabet, "=" only to
# pad the last group.
PADDED_BASE64 = re.compile(
    r"([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"
)


@FUZZ
@given(BASE64_TEXT | st.text(max_size=12))
def test_base64_text_decodes_only_if_padded_base64(text: str) -> None:
    """Padded base64 decodes as the standard decoder decodes it; anything
    else is b"" (unverified), never an exception."""
    want = base64.b64decode(text) if PADDED_BASE64.fullmatch(text) else b""
    assert decode_base64(text) == want


@pytest.mark.parametrize(
    "text",
    # "\ud800": what JSON's escape of a lone surrogate decodes to; no UTF-8.
    ["AAAA====", "QQ==\n", " QQ==", "QQ", "QQ-_", "QUE=QUE=", "QUFB\ud800"],
)
def test_non_canonical_base64_is_not_a_payload(text: str) -> None:
    assert decode_base64(text) == b""


@FUZZ
@given(st.binary(max_size=128), st.integers(1, 200))
def test_garbage_payload_bytes_leave_the_load_unverified(
    data: bytes, num_tokens: int
) -> None:
    params = {KV_TRANSFER_PARAMS_KEY: base64.b64encode(data).decode()}
    scheduler = load(params, num_tokens, 0)
    if decodes_or_value_error(data) is None:
        assert scheduler.stats.unverified == {UnverifiedReason.INVALID_CHECKSUMS: 1}


@FUZZ
@given(
    msgpack_values
    | st.text(max_size=20)
    | st.text(st.characters(categories=["Cs"]) | st.sampled_from("QUFB="), max_size=8),
    st.integers(1, 200),
)
def test_any_params_value_is_an_outcome_never_an_exception(
    value: Any, num_tokens: int
) -> None:
    load({KV_TRANSFER_PARAMS_KEY: value}, num_tokens, 0)


group_payloads = st.tuples(
    st.sampled_from([*FINGERPRINTS.values(), 0, 2**64 - 1]),
    st.sampled_from([1, 8, 16, 24, 32, 64, 2**40, 2**64 - 1])
    | st.integers(1, 2**64 - 1),
    st.integers(0, 16) | U64,
    st.lists(U64, max_size=16).map(lambda v: np.array(v, dtype=np.uint64)),
)


@FUZZ
@given(
    st.integers(1, 2**64 - 1) | st.sampled_from([1, 2]),
    st.integers(0, 300) | U64,
    st.dictionaries(st.integers(-1, 3), group_payloads, max_size=4),
    st.integers(1, 200),
    st.integers(0, 12),
)
def test_any_well_formed_payload_is_an_outcome_never_an_exception(
    tp_size: int,
    sent_tokens: int,
    groups: dict[int, tuple[int, int, int, np.ndarray]],
    num_tokens: int,
    local_blocks: int,
) -> None:
    payload = KVChecksumPayload(tp_size, sent_tokens, groups)
    num_local_tokens = min(local_blocks * 16, (num_tokens - 1) // 16 * 16)
    load({KV_TRANSFER_PARAMS_KEY: payload.to_base64()}, num_tokens, num_local_tokens)
