"""State groups (Mamba): one checksum of each request's running state at
position 0, its pieces weighted by their offset in the unsharded state, so
that the partials of TP ranks add up to the slow reference whatever the TP
size; any corrupted piece changes it.

The states sit as vLLM 0.32 allocates them: per layer, one page per block
holding the layer's states one after the other (``MambaBase.bind_kv_cache``),
all layers in one buffer.
"""

from __future__ import annotations

import math

import pytest
import torch
from checksum_reference import MOD, checksums, state_checksum
from worker_helpers import (
    CONV,
    CONV_DIM,
    CONV_PARTS,
    HEAD_DIM,
    HEADS,
    NUM_BLOCKS,
    STATE,
    StateSpec,
    layers_in_one_buffer,
    mamba2_states,
    random_tensor,
    rank_layers,
    share,
    state_values,
    unsharded,
)

from engine_patch.types import KVChecksumBlocks, KVChecksumScheduled
from engine_patch.worker import (
    KVChecksumWorker,
    KVLayout,
    KVStateLayer,
    StateShard,
    StateTensor,
    state_views,
)

# Every test with the eager CPU pass in numpy and in torch's ops.
pytestmark = pytest.mark.usefixtures("both_passes")


def reference(states: list[list[torch.Tensor]], block: int) -> int:
    return (
        sum(
            state_checksum(index, [state[block] for state in layer_states])
            for index, layer_states in enumerate(states)
        )
        % MOD
    )


def test_mamba2_split_of_the_conv_state_is_its_x_b_c_parts() -> None:
    shard = StateShard.split((CONV_DIM, 3), 0, 4, 1, CONV_PARTS)
    assert shard.runs == ((16, 16), (72, 8), (104, 8))
    assert shard.local_shape() == (32, 3)
    with pytest.raises(ValueError, match="evenly"):
        StateShard.split((CONV_DIM, 3), 0, 3, 0, CONV_PARTS)


@pytest.mark.parametrize("conv_layout", ["DS", "SD"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_partials_of_state_groups_add_up_to_the_slow_reference(
    conv_layout: str, tp: int
) -> None:
    specs = mamba2_states(conv_layout)
    states = unsharded(specs, 2, seed=tp)
    blocks = {"a": 3, "b": 0, "c": 5}
    totals = {req_id: 0 for req_id in blocks}
    fingerprints = set()
    for rank in range(tp):
        worker = KVChecksumWorker(rank_layers(specs, states, tp, rank), tp_rank=rank)
        assert worker.skipped_groups == frozenset()
        fingerprints.add(worker.fingerprints[0])
        for req_id, values in state_values(worker, blocks).items():
            assert values.shape == (1, 1)
            totals[req_id] = (totals[req_id] + int(values[0, 0])) % MOD
    assert totals == {req_id: reference(states, b) for req_id, b in blocks.items()}
    # Every rank, and every TP size, has the same fingerprint.
    assert fingerprints == {
        KVChecksumWorker(rank_layers(specs, states, 1, 0)).fingerprints[0]
    }


def test_a_state_of_one_dim_per_block_is_checksummed() -> None:
    state = random_tensor((NUM_BLOCKS, 6), torch.float32, 14)
    worker = KVChecksumWorker([KVStateLayer("m", 0, 0, (StateTensor(state),))])
    assert worker.skipped_groups == frozenset()
    assert state_values(worker, {"r": 3})["r"][0, 0] == reference([[state]], 3)


def test_shares_of_one_row_per_rank_add_up_to_the_slow_reference() -> None:
    specs = [StateSpec((4, 8), torch.float32, 0)]
    states = unsharded(specs, 1, seed=9)
    total = 0
    for rank in range(4):
        worker = KVChecksumWorker(rank_layers(specs, states, 4, rank), tp_rank=rank)
        total += int(state_values(worker, {"r": 1})["r"][0, 0])
    assert total % MOD == reference(states, 1)


def test_a_state_of_pieces_not_whole_is_zero_padded() -> None:
    # 3 x 5 bf16 = 30 bytes: 4 pieces, the last one 6 bytes and 2 zeros.
    spec = StateSpec((3, 5), torch.bfloat16, 1)
    states = unsharded([spec], 1, seed=3)
    worker = KVChecksumWorker(rank_layers([spec], states, 1, 0))
    assert state_values(worker, {"r": 2})["r"][0, 0] == reference(states, 2)


def test_states_whose_pieces_would_straddle_tp_shares_are_skipped() -> None:
    # 2 rows of 3 bf16 per rank: 12 bytes, the second piece across ranks.
    spec = StateSpec((4, 3), torch.bfloat16, 0)
    states = unsharded([spec], 1, seed=4)
    worker = KVChecksumWorker(rank_layers([spec], states, 2, 1), tp_rank=1)
    assert worker.skipped_groups == frozenset({0})


def test_states_of_unknown_split_add_up_between_peers_of_one_tp_size() -> None:
    specs = mamba2_states("DS")
    states = unsharded(specs, 2, seed=6)
    sums = []
    for source_seed in (6, 6, 7):
        other = unsharded(specs, 2, seed=source_seed)
        total = 0
        for rank in range(2):
            layers = rank_layers(specs, other, 2, rank, known_split=False)
            worker = KVChecksumWorker(layers, tp_rank=rank)
            total += int(state_values(worker, {"r": 1})["r"][0, 0])
        sums.append(total % MOD)
    assert sums[0] == sums[1] != sums[2]
    # Not the unsharded state's value: a peer of another TP size differs.
    assert sums[0] != reference(states, 1)
    # It is that of the ranks' shares one after the other.

    def shares_in_rank_order(spec: StateSpec, state: torch.Tensor) -> torch.Tensor:
        shards = [
            StateShard.split(spec.shape, spec.dim, 2, r, spec.parts) for r in (0, 1)
        ]
        return torch.cat([share(state, shard).flatten(1) for shard in shards], dim=1)

    joined = [
        KVStateLayer(
            f"model.layers.{index}.mixer",
            index,
            0,
            tuple(
                StateTensor(shares_in_rank_order(spec, state))
                for spec, state in zip(specs, layer_states, strict=True)
            ),
        )
        for index, layer_states in enumerate(states)
    ]
    assert sums[0] == state_values(KVChecksumWorker(joined), {"r": 1})["r"][0, 0]
    known = KVChecksumWorker(rank_layers(specs, states, 2, 0)).fingerprints
    unknown = KVChecksumWorker(
        rank_layers(specs, states, 2, 0, known_split=False)
    ).fingerprints
    assert known != unknown


def test_replicated_states_are_keyed_and_sends_report_replica_0() -> None:
    specs = [StateSpec((4, 8), torch.bfloat16, 0)]
    states = unsharded(specs, 1, seed=8)
    for rank in range(2):
        (layer,) = rank_layers(specs, states, 1, 0)
        replica = KVStateLayer(
            layer.name, layer.index, 0, layer.states, replicas=2, replica_index=rank
        )
        worker = KVChecksumWorker([replica], tp_rank=rank)
        assert state_values(worker, {"r": 4})["r"][0, 0] == reference(states, 4)
        worker.begin_step(
            KVChecksumScheduled(reqs_to_send={"s": KVChecksumBlocks(9, {0: (0, [4])})})
        )
        worker.after_forward()
        record = worker.take_record()
        assert record is not None
        assert record.checksums["s"][0].replica_keys == ([(2, 0)] if rank == 0 else [])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_corrupted_piece_of_any_state_is_detected(tp: int) -> None:
    specs = mamba2_states("SD")
    states = unsharded(specs, 1, seed=9)
    workers = [
        (KVChecksumWorker(layers, tp_rank=rank), layers)
        for rank in range(tp)
        for layers in [rank_layers(specs, states, tp, rank)]
    ]
    clean = [int(state_values(w, {"r": 2})["r"][0, 0]) for w, _ in workers]
    missed = 0
    checked = 0
    for (worker, layers), clean_value in zip(workers, clean, strict=True):
        for tensor in layers[0].states:
            block = tensor.state[2].view(-1).view(torch.uint8)
            # One byte of every 8-byte piece of the share, in turn.
            for offset in range(0, len(block), 8):
                position = offset + offset // 8 % 8
                if position >= len(block):
                    position = offset
                saved = int(block[position].item())
                block[position] = saved ^ 0x80
                value = int(state_values(worker, {"r": 2})["r"][0, 0])
                block[position] = saved
                missed += value == clean_value
                checked += 1
    assert checked > 300
    assert missed == 0


def test_one_step_checksums_attention_and_state_groups_together() -> None:
    attention = layers_in_one_buffer(KVLayout.PACKED_HND, torch.bfloat16, seed=10)
    specs = mamba2_states("DS")
    states = unsharded(specs, 2, seed=11)
    mamba = rank_layers(specs, states, 1, 0, group_id=1, first_index=3)
    worker = KVChecksumWorker([*attention, *mamba])
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_recv={
                "both": KVChecksumBlocks(10, {0: (0, [2, 7, 1]), 1: (0, [4])}),
                "attention": KVChecksumBlocks(3, {0: (0, [5])}),
                "state": KVChecksumBlocks(64, {1: (0, [1])}),
            }
        )
    )
    worker.on_loads_finished(["both", "attention", "state"])
    record = worker.take_record()
    assert record is not None
    got = record.checksums
    assert got["both"][0].values[:, 0].tolist() == checksums(
        attention, 0, [2, 7, 1], 10
    )
    assert got["attention"][0].values[:, 0].tolist() == checksums(attention, 0, [5], 3)
    state_reference = [
        sum(
            state_checksum(3 + index, [state[block] for state in layer_states])
            for index, layer_states in enumerate(states)
        )
        % MOD
        for block in (4, 1)
    ]
    assert [
        int(got["both"][1].values[0, 0]),
        int(got["state"][1].values[0, 0]),
    ] == state_reference
    assert got["both"][1].start == 0
    assert set(got["attention"]) == {0} and set(got["state"]) == {1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", ["contiguous", "transposed"])
def test_a_state_written_after_registration_is_checksummed_as_it_is_now(
    rows: str, dtype: torch.dtype
) -> None:
    # A block's state whose bytes are not one run (a transposed view) is
    # gathered at each pass; one that is is read in place. Neither is a copy
    # taken when the worker registered it.
    base = random_tensor((NUM_BLOCKS, 8, 4), dtype, 12)
    state = base.transpose(1, 2) if rows == "transposed" else base
    assert state[0].is_contiguous() == (rows == "contiguous")

    def worker_of(state: torch.Tensor) -> KVChecksumWorker:
        return KVChecksumWorker(
            [KVStateLayer("model.layers.0.mixer", 0, 0, (StateTensor(state),))]
        )

    worker = worker_of(state)
    before = state_values(worker, {"r": 2})["r"][0, 0]
    state[2] = random_tensor(tuple(state.shape[1:]), dtype, 13)
    after = state_values(worker, {"r": 2})["r"][0, 0]
    assert after != before
    assert after == state_values(worker_of(state.contiguous()), {"r": 2})["r"][0, 0]


def test_a_state_layer_of_negative_index_is_refused() -> None:
    state = torch.zeros(NUM_BLOCKS, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="negative index"):
        KVChecksumWorker([KVStateLayer("m", -1, 0, (StateTensor(state),))])


def test_a_group_cannot_mix_attention_and_state_layers() -> None:
    attention = layers_in_one_buffer(KVLayout.PACKED_HND, torch.bfloat16)
    specs = mamba2_states("DS")
    mamba = rank_layers(specs, unsharded(specs, 1, seed=0), 1, 0)
    with pytest.raises(ValueError, match="mix attention and state"):
        KVChecksumWorker([*attention, *mamba])


@pytest.mark.parametrize(
    "shard",
    [
        pytest.param(StateShard((8, 8), 0, ((0, 2),)), id="other-shape"),
        pytest.param(StateShard((8, 8), 2, ((0, 4),)), id="no-such-dim"),
        pytest.param(StateShard((8, 8), 0, ((-2, 4),)), id="run-before-0"),
        pytest.param(StateShard((8, 8), 0, ((6, 4),)), id="run-past-the-end"),
        pytest.param(StateShard((8, 8), 0, ((0, 4), (4, 0))), id="empty-run"),
    ],
)
def test_a_state_that_is_not_its_shards_share_is_refused(shard: StateShard) -> None:
    state = torch.zeros(NUM_BLOCKS, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a share"):
        KVChecksumWorker([KVStateLayer("m", 0, 0, (StateTensor(state, shard),))])


@pytest.mark.parametrize(
    "state",
    [
        pytest.param(torch.zeros(NUM_BLOCKS, dtype=torch.float32), id="no-state-dims"),
        pytest.param(torch.zeros(NUM_BLOCKS, 4, dtype=torch.complex128), id="16-bytes"),
    ],
)
def test_a_state_not_blocks_of_1_2_4_or_8_byte_elements_is_refused(
    state: torch.Tensor,
) -> None:
    with pytest.raises(ValueError, match=r"is not \[blocks, \.\.\.\]"):
        KVChecksumWorker([KVStateLayer("m", 0, 0, (StateTensor(state),))])


def test_state_views_cut_pages_as_vllm_binds_them() -> None:
    shapes = [(CONV_DIM // 2, CONV - 1), (HEADS // 2, HEAD_DIM, STATE)]
    dtypes = [torch.bfloat16, torch.float32]
    content = math.prod(shapes[0]) * 2 + math.prod(shapes[1]) * 4
    # vLLM's view of one layer's pages: [blocks, 1, 1, C] int8, padded pages.
    buf = random_tensor((NUM_BLOCKS, content + 64), torch.int8, seed=13)
    pages = buf[:, None, None, :content]
    got = state_views(pages, shapes, dtypes)
    # MambaBase.bind_kv_cache, verbatim.
    flat = pages.squeeze(dim=(1, 2))
    conv = flat[:, : math.prod(shapes[0]) * 2].view(torch.bfloat16).view(-1, *shapes[0])
    ssm = flat[:, math.prod(shapes[0]) * 2 :].view(torch.float32).view(-1, *shapes[1])
    for view, expected in zip(got, [conv, ssm], strict=True):
        assert view.data_ptr() == expected.data_ptr()
        assert (view.shape, view.stride()) == (expected.shape, expected.stride())
    with pytest.raises(ValueError, match="do not fit"):
        state_views(pages, [(content,)], [torch.float32])
