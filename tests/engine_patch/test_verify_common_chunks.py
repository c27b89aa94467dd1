"""``engine_patch.verify``: the chunks both sides cover with as many tokens
(:func:`common_chunks`), and a comparison over chunks that are not
consecutive (the usual consecutive ones are compared as bytes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from engine_patch.config import KVChecksumConfig
from engine_patch.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from engine_patch.payload import KVChecksumPayload
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    num_valid_tokens,
)
from engine_patch.verify import (
    Comparison,
    KVChecksumComparer,
    PendingChecksums,
    UnverifiedReason,
    _covers,
    common_chunks,
)

FINGERPRINT = 0xF00D


def test_consecutive_common_chunks_are_a_range() -> None:
    assert common_chunks((0, 5), (1, 7), 16, 80, 112) == range(1, 5)
    assert common_chunks((0, 3), (3, 5), 16, 48, 80) == range(0)


def test_a_chunk_with_fewer_tokens_on_one_side_leaves_a_gap() -> None:
    # 40 tokens on the consumer, 44 on the producer: chunk 2 holds 8 and 12,
    # chunk 3 none on either side.
    chunks = common_chunks((0, 4), (0, 4), 16, 40, 44)
    assert isinstance(chunks, np.ndarray)
    assert chunks.tolist() == [0, 1, 3]


@given(
    first=st.integers(0, 6),
    count=st.integers(0, 8),
    sent_first=st.integers(0, 6),
    sent_count=st.integers(0, 8),
    chunk_size=st.sampled_from([1, 16, 48]),
    num_tokens=st.integers(0, 700),
    more_sent_tokens=st.sampled_from([0, 0, 1, 15, 16, 40]),
)
def test_common_chunks_are_those_in_both_ranges_with_as_many_tokens(
    first: int,
    count: int,
    sent_first: int,
    sent_count: int,
    chunk_size: int,
    num_tokens: int,
    more_sent_tokens: int,
) -> None:
    sent_num_tokens = num_tokens + more_sent_tokens
    expected = [
        chunk
        for chunk in range(max(first, sent_first), first + count)
        if chunk < sent_first + sent_count
        and num_valid_tokens(chunk, chunk_size, num_tokens)
        == num_valid_tokens(chunk, chunk_size, sent_num_tokens)
    ]
    chunks = common_chunks(
        (first, first + count),
        (sent_first, sent_first + sent_count),
        chunk_size,
        num_tokens,
        sent_num_tokens,
    )
    assert list(chunks) == expected


def _compare(consumer: np.ndarray, producer: np.ndarray) -> Comparison:
    """A load of 40 tokens in four 16-token blocks (the last past the tokens)
    from a producer of 44 tokens: chunks 0, 1 and 3 are compared."""
    comparer = KVChecksumComparer(
        KVChecksumConfig(tp_size=1),
        KVCacheConfig([KVCacheGroup(FullAttentionSpec(16))]),
    )
    pending = PendingChecksums(KVChecksumBlocks(40, {0: (0, [5, 6, 7, 8])}))
    pending.expected = KVChecksumPayload(1, 44, {0: (FINGERPRINT, 16, 0, producer)})
    group = KVChecksumGroup(0, [(1, 0)], consumer[:, None].copy())
    record = KVChecksumRecord(0, 0, {"c": {0: group}}, fingerprints={0: FINGERPRINT})
    pending.reports[(0, 0)] = ({0: group}, record)
    return comparer.compare(pending)


def test_matching_chunks_around_a_gap_leave_the_gap_unverified() -> None:
    values = np.array([11, 12, 13, 14], dtype=np.uint64)
    mismatches, unverified, _, _ = _compare(values, values.copy())
    assert mismatches == {}
    assert [e.reason for e in unverified] == [UnverifiedReason.UNCOVERED]


@pytest.mark.parametrize("position", [0, 1, 3])
def test_a_mismatch_around_a_gap_names_its_block(position: int) -> None:
    values = np.array([11, 12, 13, 14], dtype=np.uint64)
    sent = values.copy()
    sent[position] ^= np.uint64(1)
    mismatches, _, num_compared, _ = _compare(values, sent)
    assert (mismatches, num_compared) == ({0: [position]}, 1)


def test_a_mismatch_only_in_the_gap_is_not_compared() -> None:
    values = np.array([11, 12, 13, 14], dtype=np.uint64)
    sent = values.copy()
    sent[2] ^= np.uint64(1)
    mismatches, unverified, _, _ = _compare(values, sent)
    assert mismatches == {}
    assert [e.reason for e in unverified] == [UnverifiedReason.UNCOVERED]


@given(
    chunks=st.one_of(
        st.builds(range, st.integers(0, 12), st.integers(0, 12)),
        st.sets(st.integers(0, 12), max_size=8).map(
            lambda s: np.array(sorted(s), dtype=np.int64)
        ),
    ),
    lo=st.integers(0, 14),
    size=st.integers(0, 6),
)
# Two chunks three apart span as many as two consecutive ones and one more.
@example(chunks=np.array([0, 3]), lo=0, size=4)
def test_chunks_cover_a_range_iff_they_hold_each_of_its_chunks(
    chunks: range | np.ndarray, lo: int, size: int
) -> None:
    # What "every loaded token was compared" rests on: a range is covered
    # only if no chunk of it is missing, consecutive chunks or not.
    hi = lo + size
    expected = set(range(lo, hi)) <= {int(c) for c in chunks}
    assert _covers(chunks, lo, hi) is expected
