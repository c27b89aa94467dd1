"""Real workers' records through the real scheduler: a producer's send and a
consumer's load of the same KV at other block ids verify across TP sizes and
replicated KV heads, and a corrupted load does not."""

from __future__ import annotations

import pytest
import torch
from kv_host_fakes import (
    FINISHED,
    FakeBlocks,
    FakeConnectorOutput,
    FakeKVCacheManager,
    consumer_request,
    producer_request,
)
from scheduler_harness import full, kv_config, make_scheduler
from worker_helpers import (
    random_tensor,
)

from engine_patch.payload import KV_TRANSFER_PARAMS_KEY
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

# Every test with the eager CPU pass in numpy and in torch's ops.
pytestmark = pytest.mark.usefixtures("both_passes")

BLOCK_SIZE, KV_HEADS, NUM_TOKENS = 16, 2, 40


def workers(kvs: list[torch.Tensor], tp: int) -> list[KVChecksumWorker]:
    """TP ranks over full-model NHD tensors [blocks, 16, 2 heads, 32]: heads
    sharded, or replicated when TP exceeds them."""
    replicas = max(1, tp // KV_HEADS)
    per_rank = max(1, KV_HEADS // tp)
    out = []
    for rank in range(tp):
        first = (rank // replicas) * per_rank
        layers = [
            KVLayer(
                f"model.layers.{index}.attn",
                index,
                0,
                kv[:, :, first : first + per_rank],
                KVLayout.PACKED_NHD,
                head_offset=first,
                replicas=replicas,
                replica_index=rank % replicas,
                total_num_kv_heads=KV_HEADS,
            )
            for index, kv in enumerate(kvs)
        ]
        out.append(KVChecksumWorker(layers, tp_rank=rank))
    return out


def scheduler(tp: int) -> KVChecksumScheduler:
    return make_scheduler(kv_config(full(BLOCK_SIZE)), tp=tp)


@pytest.mark.parametrize(
    ("producer_tp", "consumer_tp"), [(1, 1), (4, 1), (1, 4), (2, 8)]
)
@pytest.mark.parametrize("corrupt", [False, True])
def test_consumer_verifies_the_producers_kv_at_other_block_ids(
    producer_tp: int, consumer_tp: int, corrupt: bool
) -> None:
    produced = [
        random_tensor((8, BLOCK_SIZE, KV_HEADS, 32), torch.bfloat16, seed=layer)
        for layer in range(2)
    ]
    loaded = [torch.zeros_like(kv) for kv in produced]

    # The producer checksums its prompt's blocks 5, 2, 7 when it finishes.
    producer = scheduler(producer_tp)
    request = producer_request("r", NUM_TOKENS)
    request.num_computed_tokens = NUM_TOKENS
    producer.add_send(
        request, NUM_TOKENS, FakeKVCacheManager({"r": FakeBlocks.of([5, 2, 7])})
    )
    scheduled = producer.build_checksum_meta()
    records = []
    for worker in workers(produced, producer_tp):
        worker.begin_step(scheduled)
        worker.after_forward()
        record = worker.take_record()
        assert record is not None
        records.append(record)
    producer.update_from_output(FakeConnectorOutput(records), set())
    request.finish_reason = FINISHED
    params: dict[str, object] = {}
    producer.request_finished(request, params)
    assert KV_TRANSFER_PARAMS_KEY in params

    # The consumer loads them into blocks 1, 4, 3 (block 0 is the null block).
    consumer = scheduler(consumer_tp)
    load = consumer_request("r", NUM_TOKENS, params)
    consumer.on_new_request(load)
    load.num_computed_tokens = NUM_TOKENS
    consumer.add_recv(load, FakeBlocks.of([1, 4, 3]), 0)
    scheduled = consumer.build_checksum_meta()
    for src, dst in zip(produced, loaded, strict=True):
        dst[[1, 4, 3]] = src[[5, 2, 7]]
    if corrupt:
        # One bit of one token's V in the second block, on every copy.
        loaded[1].view(torch.int16)[4, 3, 1, 20] ^= 1 << 9
    records = []
    for worker in workers(loaded, consumer_tp):
        worker.begin_step(scheduled)
        worker.on_loads_finished(["r"])
        record = worker.take_record()
        assert record is not None
        records.append(record)
    failed = consumer.update_from_output(FakeConnectorOutput(records, {"r"}), set())
    assert failed == ({"r"} if corrupt else set())
    assert (consumer.stats.mismatch, consumer.stats.verified) == (
        (1, 0) if corrupt else (0, 1)
    )
