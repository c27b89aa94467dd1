"""One checksum pass per step: all requests and layers a step finishes are
checksummed together, with the same values as the slow reference whatever
the mix of requests, layouts, dtypes, replicas, spans and offloaded loads,
and at a cost in torch ops that does not grow with the number of requests
or layers."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from checksum_reference import checksums
from torch.utils._python_dispatch import TorchDispatchMode
from worker_helpers import (
    DTYPES,
    LAYOUTS,
    MIXED_REQUESTS,
    column_sums,
    layers_in_one_buffer,
    random_tensor,
    recv_all,
)

from engine_patch.types import KVChecksumBlocks, KVChecksumScheduled
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

# Every test with the eager CPU pass in numpy and in torch's ops.
pytestmark = pytest.mark.usefixtures("both_passes")


@pytest.mark.parametrize(
    "block_major", [False, True], ids=["layer_major", "block_major"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_one_pass_over_mixed_requests_equals_the_slow_reference(
    layout: KVLayout, dtype: torch.dtype, block_major: bool
) -> None:
    layers = layers_in_one_buffer(layout, dtype, block_major=block_major)
    values = recv_all(
        KVChecksumWorker(layers),
        [(r, n, {0: (start, ids)}) for r, n, start, ids in MIXED_REQUESTS],
    )
    for req_id, num_tokens, start, ids in MIXED_REQUESTS:
        got = values[req_id][0]
        assert got.shape == (len(ids), 1)
        assert got[:, 0].tolist() == checksums(layers, start, ids, num_tokens), req_id


def test_a_pass_mixes_groups_spans_layouts_and_separate_tensors() -> None:
    full = layers_in_one_buffer(KVLayout.PACKED_HND, torch.bfloat16, seed=1)
    sliding = layers_in_one_buffer(
        KVLayout.SPLIT,
        torch.float16,
        num_layers=2,
        block_size=32,
        heads=1,
        group_id=1,
        spec_type="sliding_window",
        first_index=3,
        seed=2,
    )
    # A layer of its own allocation joins group 0.
    alone = KVLayer(
        "model.layers.5.attn",
        5,
        0,
        random_tensor((12, 2, 4, 8), torch.bfloat16, seed=3),
        KVLayout.PACKED_HND,
        head_offset=2,
    )
    worker = KVChecksumWorker([*full, *sliding, alone])
    requests = [
        ("a", 70, {0: (0, [1, 2]), 1: (1, [4, 0])}),
        ("b", 40, {1: (0, [2, 3])}),
        ("c", 7, {0: (1, [9])}),
    ]
    values = recv_all(worker, requests)
    assert column_sums_of(values["a"][0]) == checksums([*full, alone], 0, [1, 2], 70)
    assert values["a"][1].shape == (4, 1)
    assert column_sums_of(values["a"][1]) == checksums(sliding, 1, [4, 0], 70, span=16)
    assert column_sums_of(values["b"][1]) == checksums(sliding, 0, [2, 3], 40, span=16)
    assert set(values["b"]) == {1}
    assert column_sums_of(values["c"][0]) == checksums([*full, alone], 1, [9], 7)


def column_sums_of(values: np.ndarray) -> list[int]:
    return [int(v) for v in values.sum(axis=1, dtype=np.uint64)]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_pass_keys_replicas_and_sends_report_replica_0(tp: int) -> None:
    # 1 KV head replicated on every rank; each rank in one pass of 3 requests.
    kv = random_tensor((6, 8, 1, 16), torch.bfloat16, seed=4)
    whole = KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD)
    requests = [("x", 20, {0: (0, [3, 1, 5])}), ("y", 8, {0: (0, [0])})]
    for rank in range(tp):
        layer = KVLayer(
            "l", 0, 0, kv.clone(), KVLayout.PACKED_NHD, replicas=tp, replica_index=rank
        )
        worker = KVChecksumWorker([layer], tp_rank=rank)
        record_values = recv_all(worker, requests)
        for req_id, num_tokens, groups in requests:
            start, ids = groups[0]
            assert record_values[req_id][0][:, 0].tolist() == checksums(
                [whole], start, ids, num_tokens
            )
        worker.begin_step(
            KVChecksumScheduled(
                reqs_to_send={r: KVChecksumBlocks(n, g) for r, n, g in requests}
            )
        )
        worker.after_forward()
        record = worker.take_record()
        assert record is not None
        for req_id, _, _ in requests:
            group = record.checksums[req_id][0]
            assert group.replica_keys == ([(tp, 0)] if rank == 0 else [])


def test_offloaded_and_remote_loads_finish_in_one_pass() -> None:
    layers = layers_in_one_buffer(KVLayout.PACKED_NHD, torch.bfloat16, seed=5)
    worker = KVChecksumWorker(layers)
    offload = KVChecksumBlocks(10, {0: (0, [4, 6, 8])})
    stored = worker.init_block_checksums(offload, {0: [b"h0", b"h1", b"h2"]})
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_recv={"remote": KVChecksumBlocks(9, {0: (0, [1, 2, 3])})},
            reqs_to_load={"offloaded": offload},
        )
    )
    worker.set_stored("offloaded", stored)
    worker.on_loads_finished(["remote", "offloaded"])
    record = worker.take_record()
    assert record is not None
    assert record.checksums["remote"][0].stored is None
    group = record.checksums["offloaded"][0]
    assert group.stored is not None and (group.stored == stored[0]).all()
    assert column_sums(group) == checksums(layers, 0, [4, 6, 8], 10)
    assert column_sums(record.checksums["remote"][0]) == checksums(
        layers, 0, [1, 2, 3], 9
    )


def test_chunks_of_one_row_give_the_same_values() -> None:
    layers = layers_in_one_buffer(KVLayout.SPLIT, torch.float32, block_major=True)
    requests = [(r, n, {0: (start, ids)}) for r, n, start, ids in MIXED_REQUESTS]
    one_row = recv_all(KVChecksumWorker(layers, max_scratch_bytes=1), requests)
    default = recv_all(KVChecksumWorker(layers), requests)
    for req_id, _, _ in requests:
        assert (one_row[req_id][0] == default[req_id][0]).all()


def test_a_bad_block_id_raises_before_any_request_is_checksummed() -> None:
    worker = KVChecksumWorker(layers_in_one_buffer(KVLayout.PACKED_NHD, torch.uint8))
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_recv={
                "good": KVChecksumBlocks(8, {0: (0, [1, 2])}),
                "bad": KVChecksumBlocks(8, {0: (0, [1, 12])}),
            }
        )
    )
    with pytest.raises(ValueError, match="block ids"):
        worker.on_loads_finished(["good", "bad"])
    assert worker.take_record() is None


class _CountOps(TorchDispatchMode):
    """Counts the torch ops run under it that compute (not views)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func is not torch.ops.aten.lift_fresh.default:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_of_one_pass(num_requests: int, num_layers: int) -> int:
    layers = layers_in_one_buffer(
        KVLayout.PACKED_HND, torch.bfloat16, num_layers=num_layers, num_blocks=64
    )
    worker = KVChecksumWorker(layers, compile=False)
    rng = random.Random(num_requests)
    loads = {
        f"r{i}": KVChecksumBlocks(9, {0: (0, rng.sample(range(64), 3))})
        for i in range(num_requests)
    }
    worker.begin_step(KVChecksumScheduled(reqs_to_recv=loads))
    with _CountOps() as counter:
        worker.on_loads_finished(list(loads))
    assert worker.take_record() is not None
    return sum(counter.ops.values())


def test_a_pass_costs_the_same_torch_ops_for_1_or_16_requests_of_2_or_8_layers() -> (
    None
):
    # Per-op dispatch, not bytes, is what small requests cost: a step's
    # checksums must not be a chain of ops per request and layer.
    single = ops_of_one_pass(1, 2)
    assert ops_of_one_pass(16, 2) == single
    assert ops_of_one_pass(16, 8) == single
    assert single <= 25
