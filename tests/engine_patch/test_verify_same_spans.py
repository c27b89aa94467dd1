"""``engine_patch.verify``: the usual load (one consumer worker, the same
spans at the same start, as many tokens on both sides) verifies by one
comparison of bytes, with the verdict the general comparison gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from engine_patch import verify
from engine_patch.config import KVChecksumConfig
from engine_patch.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
)
from engine_patch.payload import KVChecksumPayload
from engine_patch.types import KVChecksumBlocks, KVChecksumGroup, KVChecksumRecord
from engine_patch.verify import KVChecksumComparer, PendingChecksums

FINGERPRINT = 0xF00D
BLOCK_SIZE = 16


def _load(
    spec: KVCacheSpec,
    *,
    start: int,
    num_blocks: int,
    num_tokens: int,
    first_token: int,
    sent_start: int,
    sent_blocks: int,
    sent_num_tokens: int,
    bad: int | None,
    uniform: bool = False,
    sent_span: int = BLOCK_SIZE,
    second_worker: int | None = None,
    replicas: int = 1,
) -> tuple[KVChecksumComparer, PendingChecksums]:
    """A TP 1 consumer's load of ``num_blocks`` blocks from position
    ``start``, and a producer's payload of ``sent_blocks`` spans of
    ``sent_span`` tokens from ``sent_start``; the producer's value at
    position ``bad`` differs. Position ``p``'s value is ``100 + p``, or 100
    everywhere if ``uniform`` (blocks of the same KV). With
    ``second_worker``, the consumer has TP 2 and its second worker adds that
    value at every position. The consumer's first worker holds copy 0 of KV
    heads that ``replicas`` ranks hold."""
    tp_size = 1 if second_worker is None else 2
    comparer = KVChecksumComparer(
        KVChecksumConfig(tp_size=tp_size), KVCacheConfig([KVCacheGroup(spec)])
    )
    step = 0 if uniform else 1
    values = np.arange(start, start + num_blocks, dtype=np.uint64) * step + 100
    sent = np.arange(sent_start, sent_start + sent_blocks, dtype=np.uint64) * step
    sent += np.uint64(100)
    if bad is not None and sent_start <= bad < sent_start + sent_blocks:
        sent[bad - sent_start] ^= np.uint64(1)
    pending = PendingChecksums(
        KVChecksumBlocks(num_tokens, {0: (start, list(range(7, 7 + num_blocks)))}),
        first_token=first_token,
    )
    pending.expected = KVChecksumPayload(
        1, sent_num_tokens, {0: (FINGERPRINT, sent_span, sent_start, sent)}
    )
    shares = [values] if second_worker is None else [values, values * 0 + second_worker]
    for tp_rank, share in enumerate(shares):
        key = (replicas, 0) if tp_rank == 0 else (1, 0)
        group = KVChecksumGroup(start, [key], share[:, None].copy())
        record = KVChecksumRecord(
            0, tp_rank, {"c": {0: group}}, fingerprints={0: FINGERPRINT}
        )
        pending.reports[(0, tp_rank)] = ({0: group}, record)
    return comparer, pending


def _verdict(
    comparer: KVChecksumComparer, pending: PendingChecksums
) -> tuple[object, ...]:
    mismatches, unverified, num_compared, uncompared = comparer.compare(pending)
    reasons = [(e.reason, e.detail) for e in unverified]
    return mismatches, reasons, num_compared, uncompared


def _case(
    *,
    start: int,
    num_blocks: int,
    tokens_short: int,
    first_token: int,
    sent_shift: int,
    sent_extra: int,
    more_sent_tokens: int,
    bad: int | None,
    uniform: bool,
    window: bool,
    sent_span: int,
    second_worker: int | None,
    replicas: int,
) -> tuple[KVCacheSpec, dict[str, Any]]:
    """The spec and :func:`_load`'s arguments of a load described relative
    to its consumer's blocks (``USUAL``'s keys)."""
    end = start + num_blocks
    num_tokens = max(0, end * BLOCK_SIZE - tokens_short)
    spec: KVCacheSpec = (
        SlidingWindowSpec(BLOCK_SIZE, sliding_window=64)
        if window
        else FullAttentionSpec(BLOCK_SIZE)
    )
    sent_start = max(0, start + sent_shift)
    load: dict[str, Any] = {
        "start": start,
        "num_blocks": num_blocks,
        "num_tokens": num_tokens,
        "first_token": min(first_token, num_tokens),
        "sent_start": sent_start,
        "sent_blocks": max(0, end - sent_start + sent_extra),
        "sent_num_tokens": num_tokens + more_sent_tokens,
        "bad": bad,
        "uniform": uniform,
        "sent_span": sent_span,
        "second_worker": second_worker,
        "replicas": replicas,
    }
    return spec, load


# The usual load, verified; each example changes it where one condition of
# the shortcut fails (or a value differs), and must still get the general
# comparison's verdict.
USUAL: dict[str, Any] = {
    "start": 0,
    "num_blocks": 4,
    "tokens_short": 8,
    "first_token": 0,
    "sent_shift": 0,
    "sent_extra": 0,
    "more_sent_tokens": 0,
    "bad": None,
    "uniform": False,
    "window": False,
    "sent_span": BLOCK_SIZE,
    "second_worker": None,
    "replicas": 1,
}
EXAMPLES: list[dict[str, Any]] = [
    {},
    {"bad": 3},
    # The producer holds a token more: the last block is not compared.
    {"more_sent_tokens": 1},
    # The producer's blocks start a block later, with the same values.
    {"sent_shift": 1, "sent_extra": 1, "uniform": True},
    # Tokens past the consumer's blocks are not compared.
    {"tokens_short": -8},
    # The load starts before the consumer's first block.
    {"start": 1, "uniform": True},
    # A second consumer worker's share is not in the payload.
    {"second_worker": 5},
    # The producer's spans are twice as long, with the same values.
    {"sent_span": 2 * BLOCK_SIZE, "uniform": True},
    # The consumer's one worker holds one of two copies of its heads.
    {"replicas": 2},
]


def _with_examples(test: Callable[..., None]) -> Callable[..., None]:
    for changes in EXAMPLES:
        test = example(**(USUAL | changes))(test)
    return test


@given(
    start=st.integers(0, 3),
    num_blocks=st.integers(0, 6),
    # Negative: the request holds tokens past the consumer's blocks.
    tokens_short=st.integers(-20, 20),
    first_token=st.integers(0, 100),
    sent_shift=st.sampled_from([0, 0, 0, -1, 1]),
    sent_extra=st.sampled_from([0, 0, 0, -1, 1]),
    more_sent_tokens=st.sampled_from([0, 0, 0, 1, 16]),
    bad=st.none() | st.integers(0, 9),
    uniform=st.booleans(),
    window=st.booleans(),
    sent_span=st.sampled_from([BLOCK_SIZE, BLOCK_SIZE, 2 * BLOCK_SIZE]),
    second_worker=st.none() | st.sampled_from([0, 5]),
    replicas=st.sampled_from([1, 1, 1, 2]),
)
@_with_examples
def test_the_usual_load_has_the_general_comparisons_verdict(**case: Any) -> None:
    spec, load = _case(**case)
    shortcut = _verdict(*_load(spec, **load))
    with mock.patch.object(verify, "_same_spans_match", return_value=False):
        general = _verdict(*_load(spec, **load))
    assert shortcut == general


def test_the_usual_load_takes_the_shortcut() -> None:
    # Else the property above compares the general comparison with itself.
    spec, arguments = _case(**USUAL)
    load = _load(spec, **arguments)
    results: list[bool] = []

    def recorded(*args: Any) -> bool:
        results.append(shortcut(*args))
        return results[-1]

    shortcut = verify._same_spans_match
    with mock.patch.object(verify, "_same_spans_match", recorded):
        assert _verdict(*load) == ({}, [], 1, {})
    assert results == [True]
