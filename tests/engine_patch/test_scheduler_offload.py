"""KVChecksumScheduler (hand-built worker records, no torch): reloads of
offloaded KV checked against the checksums each worker stored with it."""

from __future__ import annotations

import numpy as np
from kv_host_fakes import (
    FakeBlocks,
    FakeConnector,
    FakeConnectorOutput,
    FakeRequest,
    FakeWorkers,
    token_values,
)
from scheduler_harness import (
    RNG,
    Consumer,
    R,
    full,
    kv_config,
)

from engine_patch.hashing import block_checksum_tags
from engine_patch.host import CacheHitSource
from engine_patch.kv_cache import KVCacheSpec

OFFLOAD = CacheHitSource.OFFLOAD


def hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [salt + i.to_bytes(4, "little") for i in range(n)]


def stored_values(
    values: np.ndarray, block_hashes: list[bytes], fingerprint: int = 0xF00D
) -> np.ndarray:
    return values ^ block_checksum_tags(block_hashes, fingerprint)


def offload_reload(
    stored: np.ndarray,
    loaded: np.ndarray,
    *,
    block_hashes: list[bytes],
    fail_closed: bool = True,
    hash_block_size: int | None = None,
    num_local_tokens: int = 0,
) -> Consumer:
    """An offloaded load of blocks 0..n of a request (after its
    ``num_local_tokens`` cached ones); workers report ``loaded`` and the
    stored values."""
    connector = FakeConnector(
        sources={OFFLOAD: 1}, checksum_sources=frozenset({OFFLOAD})
    )
    consumer = Consumer(
        kv_config(full(), hash_block_size=hash_block_size),
        fail_closed=fail_closed,
        connector=connector,
    )
    first = num_local_tokens // 16
    num_blocks = first + len(loaded)
    req = FakeRequest("o", num_prompt_tokens=num_blocks * 16, block_hashes=block_hashes)
    consumer.start_load(
        req, FakeBlocks.of(list(range(1, num_blocks + 1))), num_local_tokens
    )
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert not scheduled.reqs_to_recv
    assert scheduled.reqs_to_load["o"].groups == {
        0: (first, list(range(first + 1, num_blocks + 1)))
    }
    # One worker: its share is the whole checksum.
    records = consumer.workers.report("o", {0: (first, loaded)}, stored={0: stored})
    consumer.failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"o"}), set()
    )
    return consumer


def test_an_offloaded_load_verifies_against_the_stored_checksums() -> None:
    values = token_values(RNG, 3)
    block_hashes = hashes(3)
    consumer = offload_reload(
        stored_values(values, block_hashes), values, block_hashes=block_hashes
    )
    assert consumer.failed == set()
    assert consumer.stats.verified == 1
    assert consumer.connector.failures == []


def test_an_offloaded_block_with_flipped_bits_fails_and_the_connector_hears() -> None:
    values = token_values(RNG, 3)
    block_hashes = hashes(3)
    loaded = values.copy()
    loaded[1] ^= np.uint64(1 << 17)
    consumer = offload_reload(
        stored_values(values, block_hashes), loaded, block_hashes=block_hashes
    )
    assert consumer.failed == {"o"}
    assert consumer.connector.failures == [("o", {0: [1]})]
    assert consumer.stats.mismatch == 1


def test_an_offloaded_block_reloaded_at_the_wrong_position_fails() -> None:
    values = token_values(RNG, 3)
    block_hashes = hashes(3)
    # Blocks 1 and 2 come back swapped: the data is intact but the tag of
    # the position each now holds differs.
    stored = stored_values(values, block_hashes)
    loaded = values[[0, 2, 1]]
    consumer = offload_reload(stored[[0, 2, 1]], loaded, block_hashes=block_hashes)
    assert consumer.failed == {"o"}
    assert consumer.connector.failures == [("o", {0: [1, 2]})]


def test_an_offloaded_block_of_another_request_fails() -> None:
    values = token_values(RNG, 2)
    theirs = hashes(2, salt=b"other")
    consumer = offload_reload(
        stored_values(values, theirs), values, block_hashes=hashes(2)
    )
    assert consumer.connector.failures == [("o", {0: [0, 1]})]


def test_offloaded_load_after_a_prefix_hit_uses_the_hashes_of_its_positions() -> None:
    values = token_values(RNG, 2)
    block_hashes = hashes(4)
    consumer = offload_reload(
        stored_values(values, block_hashes[2:]),
        values,
        block_hashes=block_hashes,
        num_local_tokens=32,
    )
    assert consumer.failed == set()
    assert consumer.stats.verified == 1


def test_a_corrupted_offloaded_block_after_a_prefix_hit_is_named_by_its_position() -> (
    None
):
    values = token_values(RNG, 2)
    block_hashes = hashes(4)
    loaded = values.copy()
    loaded[1] ^= np.uint64(1 << 5)
    consumer = offload_reload(
        stored_values(values, block_hashes[2:]),
        loaded,
        block_hashes=block_hashes,
        num_local_tokens=32,
    )
    # The request's block 3: the second loaded after two cached ones.
    assert consumer.connector.failures == [("o", {0: [3]})]


def test_offloaded_load_with_finer_block_hashes_uses_each_blocks_last_hash() -> None:
    values = token_values(RNG, 2)
    # Hashes per 8 tokens: block b's identity is hash 2b + 1.
    block_hashes = hashes(4)
    consumer = offload_reload(
        stored_values(values, block_hashes[1::2]),
        values,
        block_hashes=block_hashes,
        hash_block_size=8,
    )
    assert consumer.failed == set()


def test_fail_open_still_tells_the_connector_of_corrupted_offloaded_kv() -> None:
    values = token_values(RNG, 2)
    block_hashes = hashes(2)
    loaded = values ^ np.uint64(1)
    consumer = offload_reload(
        stored_values(values, block_hashes),
        loaded,
        block_hashes=block_hashes,
        fail_closed=False,
    )
    assert consumer.failed == set()
    assert consumer.connector.failures == [("o", {0: [0, 1]})]


def test_an_offloaded_load_without_block_hashes_is_unverified() -> None:
    values = token_values(RNG, 3)
    consumer = offload_reload(
        values,
        values,
        block_hashes=hashes(2),  # Block 2 has no hash.
    )
    assert consumer.failed == {"o"}
    assert consumer.stats.unverified == {R.NO_BLOCK_HASH: 1}
    # The load fails, so the connector hears of it, with no positions.
    assert consumer.connector.failures == [("o", {})]


def test_an_unverified_offloaded_load_under_fail_open_is_not_a_failure() -> None:
    values = token_values(RNG, 3)
    consumer = offload_reload(values, values, block_hashes=hashes(2), fail_closed=False)
    assert consumer.failed == set()
    assert consumer.connector.failures == []
    assert consumer.stats.unverified == {R.NO_BLOCK_HASH: 1}


def test_a_worker_without_stored_checksums_leaves_the_offloaded_load_unverified() -> (
    None
):
    connector = FakeConnector(
        sources={OFFLOAD: 1}, checksum_sources=frozenset({OFFLOAD})
    )
    consumer = Consumer(kv_config(full()), connector=connector)
    req = FakeRequest("o", num_prompt_tokens=16, block_hashes=hashes(1))
    consumer.start_load(req, FakeBlocks.of([1]))
    consumer.scheduler.build_checksum_meta()
    records = consumer.workers.report("o", {0: (0, np.zeros(1, dtype=np.uint64))})
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"o"}), set()
    )
    assert failed == {"o"}
    assert consumer.stats.unverified == {R.NO_STORED: 1}


def reload_with(
    workers: FakeWorkers, *specs: KVCacheSpec, fail_closed: bool = True
) -> Consumer:
    """A reload of one block per group of ``specs``, whose workers report
    their (intact) checksums and the values they stored."""
    connector = FakeConnector(
        sources={OFFLOAD: 1}, checksum_sources=frozenset({OFFLOAD})
    )
    consumer = Consumer(
        kv_config(*specs), workers, fail_closed=fail_closed, connector=connector
    )
    block_hashes = hashes(1)
    req = FakeRequest("o", num_prompt_tokens=16, block_hashes=block_hashes)
    consumer.start_load(req, FakeBlocks.of(*([1] for _ in specs)))
    consumer.scheduler.build_checksum_meta()
    values = token_values(RNG, 1)
    stored = stored_values(values, block_hashes)
    records = consumer.workers.report(
        "o",
        {g: (0, values) for g in range(len(specs))},
        stored={g: stored for g in range(len(specs))},
    )
    consumer.failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"o"}), set()
    )
    return consumer


def test_an_offloaded_load_of_a_group_its_workers_skip_is_unverified() -> None:
    consumer = reload_with(FakeWorkers(skipped=frozenset({0})), full())
    # Its reloaded KV was never compared.
    assert consumer.failed == {"o"}
    assert consumer.connector.failures == [("o", {})]
    assert consumer.stats.verified == 0
    assert consumer.stats.unverified == {R.SKIPPED: 1}


def test_a_skipped_group_leaves_a_reload_unverified_beside_a_matching_one() -> None:
    workers = FakeWorkers(fingerprints={0: 0xF00D, 1: 0xF00D}, skipped=frozenset({1}))
    consumer = reload_with(workers, full(), full())
    assert consumer.failed == {"o"}
    assert consumer.stats.verified == 0
    assert consumer.stats.unverified == {R.SKIPPED: 1}


def test_a_skipped_group_under_fail_open_is_counted_not_failed() -> None:
    consumer = reload_with(
        FakeWorkers(skipped=frozenset({0})), full(), fail_closed=False
    )
    assert consumer.failed == set()
    assert consumer.connector.failures == []
    assert consumer.stats.unverified == {R.SKIPPED: 1}


def test_an_offloaded_load_of_drafter_layers_only_is_not_checked() -> None:
    # No worker holds layers of the group: there is nothing to compare.
    consumer = reload_with(FakeWorkers(fingerprints={}, unheld=frozenset({0})), full())
    assert consumer.failed == set()
    assert consumer.connector.failures == []
    assert consumer.stats.verified == 0
    assert not consumer.stats.unverified


def test_a_load_from_sources_without_stored_checksums_is_not_checksummed() -> None:
    connector = FakeConnector(
        sources={OFFLOAD: 8, CacheHitSource.P2P: 8},
        checksum_sources=frozenset({OFFLOAD}),
    )
    consumer = Consumer(kv_config(full()), connector=connector)
    consumer.start_load(FakeRequest("o", num_prompt_tokens=16), FakeBlocks.of([1]))
    assert consumer.scheduler.build_checksum_meta() is None
