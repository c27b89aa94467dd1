"""KVChecksumScheduler (hand-built worker records, no torch): KV heads
replicated over TP ranks, every copy checked."""

from __future__ import annotations

import numpy as np
import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnectorOutput,
    FakeWorkers,
    consumer_request,
    token_values,
)
from scheduler_harness import (
    RNG,
    Consumer,
    R,
    full,
    kv_config,
)

from engine_patch.payload import KV_TRANSFER_PARAMS_KEY, KVChecksumPayload
from engine_patch.types import KVChecksumGroup, KVChecksumRecord
from engine_patch.verify import (
    Unverified,
    sum_replicas,
)


def replica_record(
    tp_rank: int, columns: dict[tuple[int, int], np.ndarray], start: int = 0
) -> KVChecksumRecord:
    keys = list(columns)
    return KVChecksumRecord(
        pp_rank=0,
        tp_rank=tp_rank,
        checksums={
            "c": {
                0: KVChecksumGroup(
                    start, keys, np.stack([columns[k] for k in keys], axis=1)
                )
            }
        },
        fingerprints={0: 0xF00D},
    )


def replicated_load(
    head_values: list[np.ndarray], records: list[KVChecksumRecord], tp: int
) -> Consumer:
    """A consumer with TP ``tp`` loads KV whose heads' block checksums the
    producer (TP 1) sent as ``head_values``; its workers report ``records``."""
    total = sum(head_values, start=np.zeros(2, dtype=np.uint64))
    payload = KVChecksumPayload(1, 32, {0: (0xF00D, 16, 0, total)})
    consumer = Consumer(kv_config(full()), FakeWorkers(tp=tp))
    req = consumer_request("c", 32, {KV_TRANSFER_PARAMS_KEY: payload.to_base64()})
    consumer.start_load(req, FakeBlocks.of([5, 6]))
    consumer.scheduler.build_checksum_meta()
    consumer.failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"c"}), set()
    )
    return consumer


def test_every_replica_of_gqa_heads_is_checked() -> None:
    # TP 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1.
    heads = [token_values(RNG, 2), token_values(RNG, 2)]
    good = [replica_record(r, {(2, r % 2): heads[r // 2]}) for r in range(4)]
    consumer = replicated_load(heads, good, tp=4)
    assert consumer.failed == set()
    assert consumer.stats.verified == 1
    # A corrupted second copy of head 0 (rank 1) is found too.
    bad = [*good]
    bad[1] = replica_record(1, {(2, 1): heads[0] ^ np.uint64(1)})
    consumer = replicated_load(heads, bad, tp=4)
    assert consumer.failed == {"c"}


def test_layers_with_different_replica_counts_are_checked_copy_by_copy() -> None:
    # Per rank of TP 2: a latent layer on both ranks (R = 2), and one head
    # per rank of a layer with 2 KV heads (R = 1).
    latent, head0, head1 = (token_values(RNG, 2) for _ in range(3))
    records = [
        replica_record(0, {(2, 0): latent, (1, 0): head0}),
        replica_record(1, {(2, 1): latent, (1, 0): head1}),
    ]
    consumer = replicated_load([latent, head0, head1], records, tp=2)
    assert consumer.failed == set()
    records[1] = replica_record(1, {(2, 1): latent + np.uint64(1), (1, 0): head1})
    consumer = replicated_load([latent, head0, head1], records, tp=2)
    assert consumer.failed == {"c"}


def test_sum_replicas_builds_one_check_per_copy() -> None:
    a0, a1, b = (np.array([v], dtype=np.uint64) for v in (1, 2, 40))
    groups = [
        KVChecksumGroup(0, [(2, 0), (1, 0)], np.stack([a0, b], axis=1)),
        KVChecksumGroup(0, [(2, 1)], a1[:, None]),
    ]
    checks = sum_replicas(groups, 1)
    assert [c.tolist() for c in checks] == [[41], [42]]


def test_a_missing_replica_leaves_the_load_unverified() -> None:
    heads = [token_values(RNG, 2), token_values(RNG, 2)]
    # Every rank claims replica 0 of its head: replica 1 is never seen.
    records = [replica_record(r, {(2, 0): heads[r // 2]}) for r in range(4)]
    consumer = replicated_load(heads, records, tp=4)
    assert consumer.failed == {"c"}
    assert consumer.stats.unverified == {R.MISSING_REPLICA: 1}


def test_sum_replicas_raises_for_a_missing_copy() -> None:
    groups = [KVChecksumGroup(0, [(3, 0), (3, 2)], np.zeros((1, 2), dtype=np.uint64))]
    with pytest.raises(Unverified) as e:
        sum_replicas(groups, 1)
    assert e.value.reason == R.MISSING_REPLICA
    assert e.value.detail == "replica 1 of 3"
