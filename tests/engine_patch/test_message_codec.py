"""The scheduler's and workers' messages as msgpack (``message_codec``): what
is encoded decodes to the same, what cannot be carried is not encoded, and
bytes that are not a message never raise.

How a shipped record is judged by the scheduler (clean, malformed, anything
at all) is in ``test_checksum_record_fuzz.py``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_host_fakes import same_record

from engine_patch.message_codec import (
    decode_record,
    decode_scheduled,
    encode_record,
    encode_scheduled,
)
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
)

FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
U64 = st.integers(0, 2**64 - 1)
REQ_IDS = st.text(max_size=40)
GROUP_IDS = st.integers(0, 7)


@st.composite
def checksum_groups(draw: st.DrawFn) -> KVChecksumGroup:
    replica_keys = draw(
        st.lists(
            st.tuples(st.integers(1, 8), st.integers(0, 7)), min_size=1, max_size=3
        )
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))
    shape = (draw(st.integers(0, 64)), len(replica_keys))
    stored = draw(st.none() | st.integers(0, 8))
    return KVChecksumGroup(
        start=draw(st.integers(0, 2**40)),
        replica_keys=replica_keys,
        values=rng.integers(0, 2**64, shape, dtype=np.uint64),
        stored=None if stored is None else rng.integers(0, 2**64, stored, np.uint64),
    )


records = st.builds(
    KVChecksumRecord,
    pp_rank=st.integers(0, 3),
    tp_rank=st.integers(0, 7),
    checksums=st.dictionaries(
        REQ_IDS, st.dictionaries(GROUP_IDS, checksum_groups(), max_size=3), max_size=3
    ),
    skipped_groups=st.frozensets(GROUP_IDS),
    fingerprints=st.dictionaries(GROUP_IDS, U64),
    received=st.dictionaries(REQ_IDS, st.binary(max_size=64), max_size=2),
)


def assert_same_record(got: object, want: KVChecksumRecord) -> None:
    assert same_record(got, want)
    # Decoded as the types name them.
    assert isinstance(got, KVChecksumRecord)
    assert type(got.skipped_groups) is frozenset
    for groups in got.checksums.values():
        for group in groups.values():
            assert all(type(key) is tuple for key in group.replica_keys)
            assert group.values.dtype == np.uint64


@FUZZ
@given(records)
def test_a_record_decodes_to_what_was_encoded(record: KVChecksumRecord) -> None:
    data = encode_record(record)
    assert data is not None
    assert_same_record(decode_record(data), record)


blocks = st.builds(
    KVChecksumBlocks,
    num_tokens=st.integers(0, 2**20),
    groups=st.dictionaries(
        GROUP_IDS,
        st.tuples(st.integers(0, 2**20), st.lists(st.integers(0, 2**31))),
        max_size=3,
    ),
)
scheduled = st.builds(
    KVChecksumScheduled,
    reqs_to_send=st.dictionaries(REQ_IDS, blocks, max_size=3),
    reqs_to_recv=st.dictionaries(REQ_IDS, blocks, max_size=3),
    reqs_to_load=st.dictionaries(REQ_IDS, blocks, max_size=3),
)


@FUZZ
@given(scheduled)
def test_scheduled_blocks_decode_to_what_was_encoded(
    value: KVChecksumScheduled,
) -> None:
    assert decode_scheduled(encode_scheduled(value)) == value


def record_of(values: object) -> KVChecksumRecord:
    group = KVChecksumGroup(0, [(1, 0)], values)  # type: ignore[arg-type]
    return KVChecksumRecord(0, 0, {"r": {0: group}})


def test_what_msgpack_cannot_carry_is_not_encoded() -> None:
    assert encode_record(record_of(np.zeros((2, 1), dtype=np.uint64))) is not None
    # An object array's bytes would be pointers.
    assert encode_record(record_of(np.zeros((2, 1), dtype=object))) is None
    assert encode_record(KVChecksumRecord(0, 0, fingerprints={0: 2**70})) is None
    assert encode_record(None) is None
    assert encode_record("a record") is None


def test_a_record_of_the_wrong_types_does_not_decode() -> None:
    # Carried by msgpack, but values must be an array.
    data = encode_record(record_of([[0], [0]]))
    assert data is not None
    assert decode_record(data) is data


@FUZZ
@given(st.binary(max_size=200))
def test_bytes_that_are_not_a_record_come_back_as_they_are(data: bytes) -> None:
    decoded = decode_record(data)
    assert decoded is data or type(decoded) is KVChecksumRecord


def test_an_array_that_does_not_decode_leaves_the_record_undecoded() -> None:
    group = KVChecksumGroup(0, [(1, 0)], np.arange(4, dtype=np.uint64).reshape(4, 1))
    data = encode_record(KVChecksumRecord(0, 0, {"r": {0: group}}))
    assert data is not None
    # The shape [4, 1] says 4 values of 8 bytes: cut one byte off them.
    cut = data.replace(group.values.tobytes(), group.values.tobytes()[:-1])
    assert cut != data
    assert decode_record(cut) is cut


def test_scheduled_blocks_that_do_not_decode_are_nothing_to_checksum() -> None:
    assert decode_scheduled(b"\x93garbage") == KVChecksumScheduled()
