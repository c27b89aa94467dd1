"""KVChecksumWorker computes checksum v1 of ``docs/checksum.md``: it equals a slow
reference on every layout and dtype, and its partials add up across TP
shards, PP stages and block sizes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from checksum_reference import MOD, checksums
from worker_helpers import (
    DTYPES,
    LAYOUTS,
    column_sums,
    make_kv,
    random_tensor,
)

from engine_patch.hashing import block_checksum_tags, layer_fingerprint
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

# Every test with the eager CPU pass in numpy and in torch's ops.
pytestmark = pytest.mark.usefixtures("both_passes")


def load_record(
    worker: KVChecksumWorker,
    num_tokens: int,
    groups: dict[int, tuple[int, list[int]]],
    req_id: str = "req",
) -> KVChecksumRecord:
    """The worker's record of a consumer load of these blocks."""
    blocks = KVChecksumBlocks(num_tokens, groups)
    worker.begin_step(KVChecksumScheduled(reqs_to_recv={req_id: blocks}))
    worker.after_forward()
    worker.on_loads_finished([req_id])
    record = worker.take_record()
    assert record is not None
    return record


def load_values(
    worker: KVChecksumWorker, num_tokens: int, start: int, block_ids: list[int]
) -> KVChecksumGroup:
    return load_record(worker, num_tokens, {0: (start, block_ids)}).checksums["req"][0]


@pytest.mark.parametrize("view", ["contiguous", "shared_buffer", "strided_last_dim"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_worker_equals_slow_reference(
    layout: KVLayout, dtype: torch.dtype, view: str
) -> None:
    rng = random.Random(f"{layout}{dtype}{view}")
    block_size = 4
    layers = [
        KVLayer(
            f"model.layers.{index}.attn",
            index,
            0,
            make_kv(layout, dtype, view, seed=rng.randrange(1 << 30)),
            layout,
            head_offset=rng.randrange(8),
        )
        for index in (3, 11)
    ]
    worker = KVChecksumWorker(layers)
    for _ in range(3):
        block_ids = rng.sample(range(8), 3)
        start = rng.randrange(4)
        # The last block holds 1..block_size tokens.
        num_tokens = (start + 2) * block_size + rng.randint(1, block_size)
        group = load_values(worker, num_tokens, start, block_ids)
        assert group.start == start
        assert group.replica_keys == [(1, 0)]
        assert group.values.dtype == np.uint64
        assert group.values.shape == (3, 1)
        assert column_sums(group) == checksums(layers, start, block_ids, num_tokens)


@pytest.mark.parametrize(
    ("dtype", "head_size"), [(torch.uint8, 4), (torch.bfloat16, 2), (torch.float32, 1)]
)
def test_split_cells_whose_pieces_straddle_k_and_v(
    dtype: torch.dtype, head_size: int
) -> None:
    # K alone is 4 bytes: a cell's one piece is K's bytes then V's.
    kv = make_kv(KVLayout.SPLIT, dtype, "contiguous", last=head_size, seed=5)
    layer = KVLayer("l0", 0, 0, kv, KVLayout.SPLIT)
    worker = KVChecksumWorker([layer])
    assert worker.skipped_groups == frozenset()
    group = load_values(worker, 11, 1, [6, 2, 0])
    assert column_sums(group) == checksums([layer], 1, [6, 2, 0], 11)


def test_blocks_past_num_tokens_are_zero() -> None:
    kv = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous")
    layer = KVLayer("l0", 0, 0, kv, KVLayout.PACKED_NHD)
    group = load_values(KVChecksumWorker([layer]), 5, 0, [1, 2, 3, 4])
    sums = column_sums(group)
    assert sums[2:] == [0, 0]
    assert sums == checksums([layer], 0, [1, 2, 3, 4], 5)


def full_model(
    num_layers: int = 4, heads: int = 8, num_blocks: int = 6, block_size: int = 16
) -> list[torch.Tensor]:
    """Unsharded per-layer NHD KV tensors [blocks, block_size, heads, K+V]."""
    return [
        random_tensor((num_blocks, block_size, heads, 16), torch.bfloat16, seed=layer)
        for layer in range(num_layers)
    ]


def sharded_workers(
    kvs: list[torch.Tensor], tp: int, pp: int
) -> list[KVChecksumWorker]:
    """The workers of TP x PP ranks over views of the unsharded tensors."""
    heads = kvs[0].shape[2]
    per_rank = heads // tp
    per_stage = len(kvs) // pp
    workers = []
    for stage in range(pp):
        for rank in range(tp):
            heads_slice = slice(rank * per_rank, (rank + 1) * per_rank)
            layers = [
                KVLayer(
                    f"model.layers.{index}.attn",
                    index,
                    0,
                    kvs[index][:, :, heads_slice],
                    KVLayout.PACKED_NHD,
                    head_offset=rank * per_rank,
                )
                for index in range(stage * per_stage, (stage + 1) * per_stage)
            ]
            workers.append(KVChecksumWorker(layers, tp_rank=rank, pp_rank=stage))
    return workers


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (4, 2)])
def test_tp_shards_and_pp_stages_add_up(tp: int, pp: int) -> None:
    kvs = full_model()
    (whole,) = sharded_workers(kvs, 1, 1)
    expected = column_sums(load_values(whole, 70, 0, [5, 0, 3, 1, 2]))
    totals = np.zeros(5, dtype=np.uint64)
    for worker in sharded_workers(kvs, tp, pp):
        group = load_values(worker, 70, 0, [5, 0, 3, 1, 2])
        assert group.replica_keys == [(1, 0)]
        totals += group.values[:, 0]
    assert totals.tolist() == expected


def test_fingerprints_of_one_rank_per_stage_add_up() -> None:
    kvs = full_model()
    (whole,) = sharded_workers(kvs, 1, 1)
    workers = sharded_workers(kvs, 2, 2)
    ranks_0 = [w for w in workers if w._tp_rank == 0]
    total = sum(w.fingerprints[0] for w in ranks_0) % MOD
    assert total == whole.fingerprints[0]
    # Every TP rank of a stage has the same fingerprint.
    assert workers[0].fingerprints == workers[1].fingerprints
    assert workers[0].fingerprints != workers[2].fingerprints


def test_a_32_token_block_equals_its_two_16_token_halves() -> None:
    # The same tokens' KV, in 16-token blocks at ids 0..5 and in 32-token
    # blocks at ids 2, 0, 1.
    tokens = random_tensor((96, 2, 16), torch.float16, seed=7)
    small = torch.empty(6, 16, 2, 16, dtype=torch.float16)
    small[:] = tokens.view(6, 16, 2, 16)
    large = torch.empty(3, 32, 2, 16, dtype=torch.float16)
    large[[2, 0, 1]] = tokens.view(3, 32, 2, 16)
    num_tokens = 90
    small_worker = KVChecksumWorker([KVLayer("l", 0, 0, small, KVLayout.PACKED_NHD)])
    large_worker = KVChecksumWorker([KVLayer("l", 0, 0, large, KVLayout.PACKED_NHD)])
    halves = load_values(small_worker, num_tokens, 0, list(range(6))).values[:, 0]
    whole = load_values(large_worker, num_tokens, 0, [2, 0, 1]).values[:, 0]
    assert (halves.reshape(3, 2).sum(axis=1, dtype=np.uint64) == whole).all()
    assert whole.all()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("block_size", [32, 64])
def test_sliding_window_groups_are_checksummed_per_16_token_span(
    layout: KVLayout, block_size: int
) -> None:
    spans = block_size // 16
    kv = make_kv(
        layout, torch.bfloat16, "shared_buffer", num_blocks=5, block_size=block_size
    )
    sliding = KVLayer("l", 2, 0, kv, layout, spec_type="sliding_window")
    full = KVLayer("l", 2, 0, kv, layout)
    sliding_worker = KVChecksumWorker([sliding])
    full_worker = KVChecksumWorker([full])
    # From block position 2, the last span partly filled, later ones empty.
    num_tokens = 3 * block_size + 5
    group = load_values(sliding_worker, num_tokens, 2, [4, 0, 3])
    assert group.start == 2 * spans
    assert group.values.shape == (3 * spans, 1)
    values = column_sums(group)
    assert values == checksums([sliding], 2, [4, 0, 3], num_tokens, span=16)
    assert values[spans + 1 :] == [0] * (2 * spans - 1)
    assert values[spans] != 0
    # The spans of a block add up to its full-attention value.
    blocks = load_values(full_worker, num_tokens, 2, [4, 0, 3]).values[:, 0]
    per_block = group.values[:, 0].reshape(3, spans).sum(axis=1, dtype=np.uint64)
    assert (per_block == blocks).all()


def test_sliding_window_spans_equal_the_16_token_blocks_of_the_same_tokens() -> None:
    tokens = random_tensor((128, 2, 16), torch.bfloat16, seed=11)
    small = tokens.view(8, 16, 2, 16).clone()
    large = torch.empty(2, 64, 2, 16, dtype=torch.bfloat16)
    large[[1, 0]] = tokens.view(2, 64, 2, 16)
    num_tokens = 120

    def worker(kv: torch.Tensor) -> KVChecksumWorker:
        layer = KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD, spec_type="sliding_window")
        return KVChecksumWorker([layer])

    # A consumer of 16-token blocks kept the last 5 of them (one window).
    kept = load_values(worker(small), num_tokens, 3, [3, 4, 5, 6, 7])
    spans = load_values(worker(large), num_tokens, 0, [1, 0])
    assert kept.start == 3 and spans.start == 0
    assert (spans.values[3:8] == kept.values).all()


@pytest.mark.parametrize("block_size", [8, 16, 24])
def test_sliding_window_blocks_of_16_tokens_or_fewer_keep_one_value(
    block_size: int,
) -> None:
    kv = make_kv(
        KVLayout.PACKED_HND, torch.float16, "contiguous", block_size=block_size
    )
    sliding = KVLayer("l", 0, 0, kv, KVLayout.PACKED_HND, spec_type="sliding_window")
    group = load_values(KVChecksumWorker([sliding]), 3 * block_size, 1, [2, 5])
    assert group.start == 1
    assert column_sums(group) == checksums([sliding], 1, [2, 5], 3 * block_size)


def test_offloaded_sliding_window_values_are_stored_per_block() -> None:
    kv = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous", block_size=32)
    layer = KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD, spec_type="sliding_window")
    worker = KVChecksumWorker([layer])
    blocks = KVChecksumBlocks(80, {0: (0, [6, 1, 2])})
    stored = worker.init_block_checksums(blocks, {0: [b"a", b"b", b"c"]})
    block_sums = np.array(checksums([layer], 0, [6, 1, 2], 80), dtype=np.uint64)
    tags = block_checksum_tags([b"a", b"b", b"c"], worker.fingerprints[0])
    assert (stored[0] == block_sums ^ tags).all()
    worker.begin_step(KVChecksumScheduled(reqs_to_load={"r": blocks}))
    worker.set_stored("r", stored)
    worker.on_loads_finished(["r"])
    record = worker.take_record()
    assert record is not None
    group = record.checksums["r"][0]
    assert group.values.shape == (6, 1)
    assert group.stored is not None and (group.stored == stored[0]).all()


def gqa_workers(kv: torch.Tensor, tp: int) -> list[KVChecksumWorker]:
    """TP ranks over a layer with fewer KV heads than ranks: each head
    replicated on ``tp // heads`` ranks."""
    heads = kv.shape[2]
    replicas = tp // heads
    return [
        KVChecksumWorker(
            [
                KVLayer(
                    "l",
                    0,
                    0,
                    kv[:, :, [rank // replicas]].clone(),
                    KVLayout.PACKED_NHD,
                    head_offset=rank // replicas,
                    replicas=replicas,
                    replica_index=rank % replicas,
                )
            ],
            tp_rank=rank,
        )
        for rank in range(tp)
    ]


def test_gqa_replicas_are_keyed_and_each_copy_adds_up() -> None:
    kv = random_tensor((4, 16, 2, 32), torch.bfloat16, seed=3)
    expected = checksums([KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD)], 0, [3, 1], 20)
    per_copy = {0: np.zeros(2, dtype=np.uint64), 1: np.zeros(2, dtype=np.uint64)}
    for rank, worker in enumerate(gqa_workers(kv, 4)):
        group = load_values(worker, 20, 0, [3, 1])
        assert group.replica_keys == [(2, rank % 2)]
        per_copy[rank % 2] += group.values[:, 0]
    assert per_copy[0].tolist() == expected
    assert per_copy[1].tolist() == expected


def test_layers_of_different_replica_keys_fill_their_own_columns() -> None:
    # Layers with other KV head counts in one group: on this rank one holds
    # its own heads, the other a second copy of replicated ones.
    kv_a = random_tensor((8, 4, 2, 16), torch.bfloat16, seed=5)
    kv_b = random_tensor((8, 4, 2, 16), torch.bfloat16, seed=6)
    a = KVLayer("model.layers.0.attn", 0, 0, kv_a, KVLayout.PACKED_NHD)
    b = KVLayer(
        "model.layers.1.attn",
        1,
        0,
        kv_b,
        KVLayout.PACKED_NHD,
        replicas=2,
        replica_index=1,
    )
    worker = KVChecksumWorker([a, b], tp_rank=1)
    loads = {
        "r": KVChecksumBlocks(7, {0: (0, [2, 5])}),
        "s": KVChecksumBlocks(5, {0: (0, [6, 1])}),
    }
    worker.begin_step(KVChecksumScheduled(reqs_to_recv=loads))
    worker.on_loads_finished(list(loads))
    record = worker.take_record()
    assert record is not None
    for req_id, blocks in loads.items():
        group = record.checksums[req_id][0]
        (_, block_ids), num_tokens = blocks.groups[0], blocks.num_tokens
        assert group.replica_keys == [(1, 0), (2, 1)]
        assert group.values[:, 0].tolist() == checksums([a], 0, block_ids, num_tokens)
        assert group.values[:, 1].tolist() == checksums([b], 0, block_ids, num_tokens)


def test_sends_report_only_replica_0_so_the_ranks_sum_to_the_model() -> None:
    kv = random_tensor((4, 16, 2, 32), torch.bfloat16, seed=3)
    expected = checksums([KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD)], 0, [3, 1], 20)
    total = np.zeros(2, dtype=np.uint64)
    for rank, worker in enumerate(gqa_workers(kv, 4)):
        blocks = KVChecksumBlocks(20, {0: (0, [3, 1])})
        worker.begin_step(KVChecksumScheduled(reqs_to_send={"p": blocks}))
        worker.after_forward()
        record = worker.take_record()
        assert record is not None
        group = record.checksums["p"][0]
        assert group.replica_keys == ([(2, 0)] if rank % 2 == 0 else [])
        assert group.values.shape == (2, len(group.replica_keys))
        total += group.values.sum(axis=1, dtype=np.uint64)
    assert total.tolist() == expected


def test_mla_latent_replicated_on_every_rank() -> None:
    latent = random_tensor((4, 16, 1, 36), torch.bfloat16, seed=9)  # 72 bytes
    layer = KVLayer("mla", 2, 0, latent, KVLayout.PACKED_NHD, replicas=2)
    copies = [
        KVChecksumWorker([layer]),
        KVChecksumWorker(
            [
                KVLayer(
                    "mla",
                    2,
                    0,
                    latent.clone(),
                    KVLayout.PACKED_NHD,
                    replicas=2,
                    replica_index=1,
                )
            ],
            tp_rank=1,
        ),
    ]
    expected = checksums([layer], 0, [0, 2], 30)
    for index, worker in enumerate(copies):
        group = load_values(worker, 30, 0, [0, 2])
        assert group.replica_keys == [(2, index)]
        assert group.values[:, 0].tolist() == expected


def test_layers_sharing_one_cache_are_counted_once() -> None:
    kv = random_tensor((4, 2, 16, 16), torch.float16, seed=4)
    target = KVLayer("model.layers.1.attn", 1, 0, kv, KVLayout.PACKED_HND)
    sharing = KVLayer("model.layers.5.attn", 5, 0, kv, KVLayout.PACKED_HND)
    alone = KVChecksumWorker([target])
    shared = KVChecksumWorker([sharing, target])
    assert load_values(shared, 40, 0, [2, 3, 0]).values.tolist() == (
        load_values(alone, 40, 0, [2, 3, 0]).values.tolist()
    )
    assert shared.fingerprints == alone.fingerprints
    # The same tensor in another group (hybrid models share buffers) counts
    # in each group.
    other = KVLayer("model.layers.5.attn", 5, 1, kv, KVLayout.PACKED_HND)
    both = KVChecksumWorker([target, other])
    record = load_record(both, 40, {0: (0, [2]), 1: (0, [2])})
    assert record.checksums["req"][0].values.tolist() == [
        [v] for v in checksums([target], 0, [2], 40)
    ]
    assert record.checksums["req"][1].values.tolist() == [
        [v] for v in checksums([other], 0, [2], 40)
    ]


def test_groups_of_cells_not_whole_pieces_are_skipped() -> None:
    good = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous")
    # 6 bf16 = 12 bytes per cell; fp8 SPLIT head size 2 = 4 bytes per cell.
    odd = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous", last=6)
    tiny = make_kv(KVLayout.SPLIT, torch.uint8, "contiguous", last=2)
    worker = KVChecksumWorker(
        [
            KVLayer("a", 0, 0, good, KVLayout.PACKED_NHD),
            KVLayer("b", 1, 1, good.clone(), KVLayout.PACKED_NHD),
            KVLayer("c", 2, 1, odd, KVLayout.PACKED_NHD),
            KVLayer("d", 3, 2, tiny, KVLayout.SPLIT),
        ]
    )
    assert worker.skipped_groups == frozenset({1, 2})
    assert set(worker.fingerprints) == {0, 1, 2}
    record = load_record(worker, 8, {0: (0, [1, 2]), 1: (0, [1, 2]), 2: (0, [1, 2])})
    assert record.skipped_groups == frozenset({1, 2})
    assert set(record.checksums["req"]) == {0}


def test_fingerprint_is_the_sum_of_layer_fingerprints() -> None:
    kv = make_kv(KVLayout.SPLIT, torch.bfloat16, "contiguous")
    worker = KVChecksumWorker(
        [
            KVLayer("x.0", 0, 0, kv, KVLayout.SPLIT),
            KVLayer("x.1", 1, 0, kv.clone(), KVLayout.SPLIT),
            KVLayer(
                "x.2", 2, 1, kv.clone(), KVLayout.SPLIT, spec_type="sliding_window"
            ),
        ]
    )
    expected = (
        layer_fingerprint("x.0", "full_attention", "bfloat16", 32)
        + layer_fingerprint("x.1", "full_attention", "bfloat16", 32)
    ) % MOD
    assert worker.fingerprints == {
        0: expected,
        1: layer_fingerprint("x.2", "sliding_window", "bfloat16", 32),
    }


def offload_worker(kv: torch.Tensor) -> KVChecksumWorker:
    return KVChecksumWorker(
        [KVLayer("l", 0, 0, kv, KVLayout.PACKED_HND, head_offset=2)], tp_rank=1
    )


def test_offloaded_values_come_back_with_the_load_and_check_out() -> None:
    kv = make_kv(KVLayout.PACKED_HND, torch.bfloat16, "contiguous")
    worker = offload_worker(kv)
    hashes = [b"h0", b"h1", b"h2"]
    stored = worker.init_block_checksums(
        KVChecksumBlocks(11, {0: (0, [4, 1, 6])}), {0: hashes}
    )
    expected_sums = np.array(checksums(worker_layers(kv), 0, [4, 1, 6], 11), np.uint64)
    tags = block_checksum_tags(hashes, worker.fingerprints[0])
    assert (stored[0] == expected_sums ^ tags).all()

    # Offloaded, then reloaded into other blocks; block 2 decayed meanwhile.
    kv[[0, 2, 3]] = kv[[4, 1, 6]].clone()
    kv[3, 1, 2, 0] += 1
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_load={"r": KVChecksumBlocks(11, {0: (0, [0, 2, 3])})}
        )
    )
    worker.set_stored("r", stored)
    worker.on_loads_finished(["r"])
    record = worker.take_record()
    assert record is not None
    group = record.checksums["r"][0]
    assert group.stored is not None
    assert (group.stored == stored[0]).all()
    sums = group.values.sum(axis=1, dtype=np.uint64)
    assert (sums ^ tags != group.stored).tolist() == [False, False, True]
    # At another position the same data gets another tag.
    other_tags = block_checksum_tags([b"h1", b"h0", b"h2"], worker.fingerprints[0])
    assert (sums ^ other_tags != group.stored)[:2].all()


def worker_layers(kv: torch.Tensor) -> list[KVLayer]:
    return [KVLayer("l", 0, 0, kv, KVLayout.PACKED_HND, head_offset=2)]


def test_a_load_without_its_stored_values_is_not_reported() -> None:
    kv = make_kv(KVLayout.PACKED_HND, torch.bfloat16, "contiguous")
    worker = offload_worker(kv)
    blocks = KVChecksumBlocks(8, {0: (0, [0, 1])})
    worker.begin_step(KVChecksumScheduled(reqs_to_load={"r": blocks, "s": blocks}))
    worker.set_stored("s", {0: np.zeros(1, dtype=np.uint64)})  # One value short.
    worker.on_loads_finished(["r", "s"])
    assert worker.take_record() is None


def test_init_block_checksums_needs_a_hash_per_block() -> None:
    worker = offload_worker(make_kv(KVLayout.PACKED_HND, torch.bfloat16, "contiguous"))
    blocks = KVChecksumBlocks(8, {0: (0, [0, 1])})
    with pytest.raises(ValueError, match="2 blocks but 1 block hashes"):
        worker.init_block_checksums(blocks, {0: [b"x"]})
    with pytest.raises(ValueError, match="2 blocks but no block hashes"):
        worker.init_block_checksums(blocks, {})


def test_record_lifecycle() -> None:
    kv = make_kv(KVLayout.SPLIT, torch.bfloat16, "contiguous")
    worker = KVChecksumWorker([KVLayer("l", 0, 0, kv, KVLayout.SPLIT)], pp_rank=1)
    worker.begin_step(None)
    worker.after_forward()
    assert worker.take_record() is None

    # A load checksummed in the step it finishes, not the step it starts.
    blocks = KVChecksumBlocks(6, {0: (0, [3, 4])})
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_recv={"load": blocks, "gone": blocks},
            # A group this worker holds no layer of: reported empty.
            reqs_to_send={"send": KVChecksumBlocks(6, {7: (0, [3, 4])})},
        )
    )
    worker.after_forward()
    worker.add_received("load", b"payload")
    record = worker.take_record()
    assert record is not None
    assert record.pp_rank == 1 and record.tp_rank == 0
    assert record.checksums == {"send": {}}
    assert record.received == {"load": b"payload"}
    assert record.fingerprints == worker.fingerprints

    worker.begin_step(None)
    worker.request_finished(["gone"])
    worker.on_loads_finished(["load", "gone", "unknown"])
    record = worker.take_record()
    assert record is not None
    assert list(record.checksums) == ["load"]
    assert record.received == {}
    layer = KVLayer("l", 0, 0, kv, KVLayout.SPLIT)
    assert column_sums(record.checksums["load"][0]) == checksums([layer], 0, [3, 4], 6)
    assert worker.take_record() is None


def test_sends_not_checksummed_by_the_step_that_scheduled_them_are_dropped() -> None:
    kv = make_kv(KVLayout.SPLIT, torch.bfloat16, "contiguous")
    worker = KVChecksumWorker([KVLayer("l", 0, 0, kv, KVLayout.SPLIT)])
    blocks = KVChecksumBlocks(6, {0: (0, [3, 4])})
    worker.begin_step(KVChecksumScheduled(reqs_to_send={"send": blocks}))
    worker.begin_step(None)
    worker.after_forward()
    assert worker.take_record() is None


def test_chunking_bounds_scratch_without_changing_values() -> None:
    kv = make_kv(KVLayout.PACKED_NHD, torch.float32, "shared_buffer", num_blocks=32)
    layers = [KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD)]
    ids = list(range(31, -1, -1))
    one_block_at_a_time = KVChecksumWorker(layers, max_scratch_bytes=1)
    default = KVChecksumWorker(layers)
    assert (
        load_values(one_block_at_a_time, 120, 0, ids).values.tolist()
        == load_values(default, 120, 0, ids).values.tolist()
    )


def test_steps_may_run_in_and_out_of_inference_mode() -> None:
    kv = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous")
    layer = KVLayer("l", 0, 0, kv, KVLayout.PACKED_NHD)
    worker = KVChecksumWorker([layer])
    with torch.inference_mode():
        inside = load_values(worker, 20, 0, [1, 2, 3]).values
    outside = load_values(worker, 20, 0, [1, 2, 3]).values
    assert (inside == outside).all()
    assert column_sums(load_values(worker, 20, 0, [1, 2, 3])) == checksums(
        [layer], 0, [1, 2, 3], 20
    )


def test_distinct_layers_sharing_an_index_both_count_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous")
    layers = [
        KVLayer("model.layers.0.self_attn", 0, 0, kv, KVLayout.PACKED_NHD),
        KVLayer("model.layers.0.cross_attn", 0, 0, kv.flip(0), KVLayout.PACKED_NHD),
        KVLayer("model.layers.1.self_attn", 1, 0, kv.roll(1, 0), KVLayout.PACKED_NHD),
    ]
    worker = KVChecksumWorker(layers)
    # Only the shared index is named.
    assert "share a layer index ([0])" in caplog.text
    assert column_sums(load_values(worker, 9, 0, [4, 5])) == checksums(
        layers, 0, [4, 5], 9
    )


def test_bad_layers_and_blocks_raise() -> None:
    kv = make_kv(KVLayout.PACKED_NHD, torch.bfloat16, "contiguous")
    with pytest.raises(ValueError, match="4 dims"):
        KVChecksumWorker([KVLayer("l", 0, 0, kv[None], KVLayout.PACKED_NHD)])
    with pytest.raises(ValueError, match="SPLIT"):
        KVChecksumWorker([KVLayer("l", 0, 0, kv[None], KVLayout.SPLIT)])
    with pytest.raises(ValueError, match="block sizes"):
        KVChecksumWorker(
            [
                KVLayer("a", 0, 0, kv, KVLayout.PACKED_NHD),
                KVLayer("b", 1, 0, kv[:, :2].clone(), KVLayout.PACKED_NHD),
            ]
        )
    with pytest.raises(ValueError, match="spec types"):
        KVChecksumWorker(
            [
                KVLayer("a", 0, 0, kv, KVLayout.PACKED_NHD),
                KVLayer("b", 1, 0, kv.clone(), KVLayout.PACKED_NHD, "sliding_window"),
            ]
        )
    with pytest.raises(ValueError, match="replica"):
        KVChecksumWorker([KVLayer("a", 0, 0, kv, KVLayout.PACKED_NHD, replica_index=1)])
    # Negative coordinates would weigh pieces as no peer does.
    with pytest.raises(ValueError, match="negative index or head offset"):
        KVChecksumWorker([KVLayer("a", -1, 0, kv, KVLayout.PACKED_NHD)])
    with pytest.raises(ValueError, match="negative index or head offset"):
        KVChecksumWorker([KVLayer("a", 0, 0, kv, KVLayout.PACKED_NHD, head_offset=-1)])
    worker = KVChecksumWorker([KVLayer("a", 0, 0, kv, KVLayout.PACKED_NHD)])
    with pytest.raises(ValueError, match="block ids"):
        load_values(worker, 8, 0, [0, 8])
