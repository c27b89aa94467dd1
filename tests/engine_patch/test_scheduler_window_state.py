"""KVChecksumScheduler (hand-built worker records, no torch): sliding-window
groups and Mamba state groups."""

from __future__ import annotations

import base64
import collections

import numpy as np
import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnectorOutput,
    FakeWorkers,
    block_sums,
    consumer_request,
    scheduled_values,
    token_values,
)
from scheduler_harness import (
    RNG,
    Consumer,
    Producer,
    R,
    corrupt,
    full,
    kv_config,
    window_blocks,
)

from engine_patch.kv_cache import (
    MambaSpec,
    SlidingWindowSpec,
)
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY, KVChecksumPayload


def test_a_sliding_window_group_verifies_its_transferred_blocks() -> None:
    # 100 tokens, window 20 in blocks of 16: the last 3 blocks are transferred.
    config = kv_config(full(), SlidingWindowSpec(16, sliding_window=20))
    tokens = {0: token_values(RNG, 100), 1: token_values(RNG, 100)}
    workers = FakeWorkers(fingerprints={0: 1, 1: 2})
    producer = Producer(config, workers)
    encoded = producer.send(
        100, FakeBlocks.of(list(range(1, 8)), [None, None, None, None, 5, 6, 7]), tokens
    )
    consumer = Consumer(config, FakeWorkers(fingerprints={0: 1, 1: 2}))
    req = consumer_request("c", 100, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.start_load(
        req, FakeBlocks.of(list(range(11, 18)), [None, None, 20, 21, 22, 23, 24])
    )
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_recv["c"].groups[1] == (4, [22, 23, 24])
    bad = {0: tokens[0], 1: corrupt(tokens[1], 99)}
    values = scheduled_values(scheduled.reqs_to_recv["c"], bad, config)
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(consumer.workers.report("c", values), {"c"}), set()
    )
    assert failed == {"c"}


def window_load(
    producer_bs: int,
    consumer_bs: int,
    window: int,
    num_tokens: int,
    *,
    bad_token: int | None = None,
) -> Consumer:
    """A model with a full-attention and a sliding-window group: the
    producer sends, the consumer loads (its window's tokens the producer
    did not keep hold garbage: no transfer writes them) and verifies."""
    specs = {
        bs: kv_config(full(bs), SlidingWindowSpec(bs, sliding_window=window))
        for bs in (producer_bs, consumer_bs)
    }
    workers = {0: 1, 1: 2}
    tokens = {g: token_values(RNG, num_tokens) for g in range(2)}

    def blocks(bs: int, first_id: int) -> FakeBlocks:
        count = -(-num_tokens // bs)
        spec = specs[bs].kv_cache_groups[1].kv_cache_spec
        assert isinstance(spec, SlidingWindowSpec)
        return FakeBlocks.of(
            list(range(first_id, first_id + count)),
            window_blocks(spec, num_tokens, first_id + 100),
        )

    producer = Producer(specs[producer_bs], FakeWorkers(fingerprints=workers))
    sent_blocks = blocks(producer_bs, 1)
    encoded = producer.send(num_tokens, sent_blocks, tokens)
    # What the transfer writes: the producer's kept window; the rest of the
    # consumer's kept blocks is garbage.
    first_kept = next(i for i, b in enumerate(sent_blocks.blocks[1]) if not b.is_null)
    loaded = {0: tokens[0], 1: token_values(RNG, num_tokens)}
    kept = slice(first_kept * producer_bs, num_tokens)
    loaded[1][kept] = tokens[1][kept]
    if bad_token is not None:
        loaded[1] = corrupt(loaded[1], bad_token)
    consumer = Consumer(specs[consumer_bs], FakeWorkers(fingerprints=workers))
    req = consumer_request("c", num_tokens, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.failed = consumer.load(req, blocks(consumer_bs, 1), loaded)
    return consumer


SLIDING_PAIRS = [(32, 16), (16, 32), (64, 16), (16, 64), (32, 64), (64, 32)]


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_PAIRS)
def test_clean_sliding_window_loads_verify_between_block_sizes(
    producer_bs: int, consumer_bs: int
) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    for window in (17, 20, 33, 48, 100):
        for num_tokens in range(1, 160, 3):
            consumer = window_load(producer_bs, consumer_bs, window, num_tokens)
            stats = consumer.stats
            outcomes["verified" if stats.verified else str(dict(stats.unverified))] += 1
    assert outcomes == {"verified": 5 * len(range(1, 160, 3))}


def kept_blocks(bs: int, window: int, num_tokens: int) -> range:
    """Positions of the sliding-window blocks a side of block size ``bs``
    keeps (and a P/D transfer moves)."""
    positions = window_blocks(
        SlidingWindowSpec(bs, sliding_window=window), num_tokens, 0
    )
    return range(sum(b is None for b in positions), len(positions))


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_PAIRS)
def test_verified_sliding_window_loads_name_the_blocks_holding_unsent_tokens(
    producer_bs: int, consumer_bs: int
) -> None:
    # The consumer's first kept blocks can start before the producer's: their
    # tokens before the producer's first are garbage (outside the request's
    # window), and no other request may reuse those blocks.
    seen_unsent = 0
    for window in (17, 20, 33, 48, 100):
        for num_tokens in range(1, 160, 3):
            consumer = window_load(producer_bs, consumer_bs, window, num_tokens)
            assert consumer.stats.verified == 1
            first_sent = kept_blocks(producer_bs, window, num_tokens)[0] * producer_bs
            expected = [
                (pos * consumer_bs, (pos + 1) * consumer_bs)
                for pos in kept_blocks(consumer_bs, window, num_tokens)
                if pos * consumer_bs < first_sent
            ]
            uncompared = consumer.scheduler.take_uncompared_blocks()
            assert uncompared == ({"c": expected} if expected else {}), (
                window,
                num_tokens,
            )
            seen_unsent += bool(expected)
    if producer_bs < consumer_bs:
        assert seen_unsent  # The case arises.


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_PAIRS)
@pytest.mark.parametrize("from_end", [1, 16, 40])
def test_a_corrupted_token_in_the_window_fails_between_block_sizes(
    producer_bs: int, consumer_bs: int, from_end: int
) -> None:
    # Window 48: the last 48 tokens (and the one before, which a recomputed
    # last token reads) are compared.
    consumer = window_load(producer_bs, consumer_bs, 48, 150, bad_token=150 - from_end)
    assert consumer.failed == {"c"}
    assert consumer.stats.mismatch == 1


def test_a_sliding_window_payload_has_one_value_per_16_tokens() -> None:
    config = kv_config(full(64), SlidingWindowSpec(64, sliding_window=100))
    tokens = {g: token_values(RNG, 300) for g in range(2)}
    spec = config.kv_cache_groups[1].kv_cache_spec
    assert isinstance(spec, SlidingWindowSpec)
    producer = Producer(config, FakeWorkers(fingerprints={0: 1, 1: 2}))
    encoded = producer.send(
        300, FakeBlocks.of(list(range(1, 6)), window_blocks(spec, 300, 10)), tokens
    )
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    # Blocks 2..4 of 64 tokens kept: spans of 16 tokens 8..19.
    _, span, start, values = payload.groups[1]
    assert (span, start) == (16, 8)
    np.testing.assert_array_equal(values, block_sums(tokens[1], 16, 8, 12, 300))
    # Full attention: a value per block.
    assert payload.groups[0][1:3] == (64, 0)
    assert len(payload.groups[0][3]) == 5


def mamba_load(
    spec: MambaSpec, producer_tp: int, consumer_tp: int, state: int, loaded: int
) -> Consumer:
    config = kv_config(full(), spec)
    payload = KVChecksumPayload(
        producer_tp,
        40,
        {
            0: (1, 16, 0, np.array([5, 6, 7], dtype=np.uint64)),
            1: (2, spec.block_size, 0, np.array([state], dtype=np.uint64)),
        },
    )
    consumer = Consumer(config, FakeWorkers(tp=consumer_tp, fingerprints={0: 1, 1: 2}))
    req = consumer_request("c", 40, {KV_TRANSFER_PARAMS_KEY: payload.to_base64()})
    consumer.start_load(req, FakeBlocks.of([4, 5, 6], [None, 9]))
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_recv["c"].groups[1] == (0, [9])
    values = {
        0: (0, np.array([5, 6, 7], dtype=np.uint64)),
        1: (0, np.array([loaded], dtype=np.uint64)),
    }
    consumer.failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(consumer.workers.report("c", values), {"c"}), set()
    )
    return consumer


def test_mamba_state_compares_as_one_block_whatever_the_block_size() -> None:
    consumer = mamba_load(MambaSpec(block_size=4096), 1, 1, state=77, loaded=77)
    assert consumer.failed == set()
    assert consumer.stats.verified == 1
    consumer = mamba_load(MambaSpec(block_size=4096), 1, 1, state=77, loaded=78)
    assert consumer.failed == {"c"}
    assert consumer.stats.mismatch == 1


def test_mamba_state_without_tp_splits_is_unverified_across_tp_sizes() -> None:
    consumer = mamba_load(MambaSpec(block_size=64), 2, 1, state=77, loaded=77)
    assert consumer.failed == {"c"}
    assert consumer.stats.unverified == {R.MAMBA_TP: 1}


@pytest.mark.parametrize(
    "spec",
    [MambaSpec(block_size=64, state_splits=(1,)), MambaSpec(64, tp_replicated=True)],
)
def test_mamba_state_with_tp_splits_or_replicated_verifies_across_tp_sizes(
    spec: MambaSpec,
) -> None:
    consumer = mamba_load(spec, 2, 1, state=77, loaded=77)
    assert consumer.failed == set()
    assert consumer.stats.verified == 1
