"""KVGuard's adapter for vLLM's state (Mamba) groups, against vLLM 0.32's own
spec classes and shape calculators: the layers it hands the workers cut the
states out of vLLM's pages as vLLM binds them, place each TP rank's share so
that the partials of any TP size add up, and say "unknown split" where vLLM's
layout does not say it.

No servers: these run in vLLM's environment (``make test-vllm``) in seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

from engine_patch import kv_cache
from engine_patch.types import KVChecksumBlocks, KVChecksumScheduled
from engine_patch.vllm.host import (
    UnsupportedKVCacheError,
    convert_kv_cache_config,
    kv_layers,
)
from engine_patch.vllm.states import model_n_groups, state_shards
from engine_patch.worker import KVChecksumWorker, KVStateLayer

pytestmark = pytest.mark.vllm

# A Mamba2 mixer: intermediate 64 (8 heads of 8), 4 groups of state 16,
# conv kernel 4.
INTERMEDIATE, N_GROUPS, STATE, HEADS, HEAD_DIM, KERNEL = 64, 4, 16, 8, 8, 4
NUM_BLOCKS = 5
MAX_MODEL_LEN = 512
PAGE_PADDING = 24
LAYERS = ("model.layers.0.mixer", "model.layers.2.mixer")


@pytest.fixture(autouse=True)
def conv_layout_ds(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's "DS" conv state layout (``VLLM_SSM_CONV_STATE_LAYOUT=DS``),
    the one NixlConnector needs for state groups."""
    monkeypatch.setattr(mamba_utils, "get_conv_state_layout", lambda: "DS")
    yield


def mamba2_spec(tp: int, n_groups: int = N_GROUPS) -> MambaSpec:
    """vLLM's spec of the mixer's layers on a rank of TP ``tp``, as
    ``MambaBase.get_kv_cache_spec`` makes it."""
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp, INTERMEDIATE, n_groups, HEADS, HEAD_DIM, STATE, KERNEL
    )
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(
        torch.bfloat16, "auto", "float32"
    )
    return MambaSpec(
        block_size=MAX_MODEL_LEN,
        shapes=shapes,
        dtypes=dtypes,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )


def vllm_config(tp: int, n_groups: int = N_GROUPS) -> Any:
    """The parts of a ``VllmConfig`` the adapter reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(mamba_n_groups=n_groups),
            get_total_num_kv_heads=lambda: 2,
        ),
    )


def kv_config(spec: MambaSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def unsharded_states(seed: int) -> list[list[torch.Tensor]]:
    """Per layer, its random conv and SSM states ``[blocks, *shape]``, of
    TP 1's shapes (the whole state)."""
    generator = torch.Generator().manual_seed(seed)
    spec = mamba2_spec(1)
    return [
        [
            torch.randn((NUM_BLOCKS, *shape), generator=generator).to(dtype)
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
        ]
        for _ in LAYERS
    ]


def rank_pages(
    states: list[list[torch.Tensor]], tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """Each layer's ``[blocks, 1, 1, page]`` int8 pages on ``rank`` as vLLM
    lays them out: the rank's share of x, B and C of the conv state, then
    its heads of the SSM state, then padding."""
    spec = mamba2_spec(tp)
    x, groups = INTERMEDIATE // tp, N_GROUPS * STATE // tp
    starts = (rank * x, INTERMEDIATE + rank * groups, INTERMEDIATE + N_GROUPS * STATE)
    pages = {}
    for name, (conv, ssm) in zip(LAYERS, states, strict=True):
        conv_share = torch.cat(
            [
                conv[:, starts[0] : starts[0] + x],
                conv[:, starts[1] : starts[1] + groups],
                conv[:, starts[2] + rank * groups : starts[2] + (rank + 1) * groups],
            ],
            dim=1,
        )
        heads = HEADS // tp
        ssm_share = ssm[:, rank * heads : (rank + 1) * heads]
        assert conv_share.shape[1:] == spec.shapes[0]
        assert ssm_share.shape[1:] == spec.shapes[1]
        body = torch.cat(
            [
                conv_share.contiguous().view(torch.int8).flatten(1),
                ssm_share.contiguous().view(torch.int8).flatten(1),
                torch.zeros((NUM_BLOCKS, PAGE_PADDING), dtype=torch.int8),
            ],
            dim=1,
        )
        pages[name] = body[:, None, None, :]
    return pages


def state_value(worker: KVChecksumWorker, block: int) -> int:
    """The state group's value of a load of ``block`` on this worker."""
    worker.begin_step(
        KVChecksumScheduled(reqs_to_recv={"r": KVChecksumBlocks(40, {0: (0, [block])})})
    )
    worker.on_loads_finished(["r"])
    record = worker.take_record()
    assert record is not None
    return int(record.checksums["r"][0].values.sum())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_conv_state_shares_are_the_ranks_x_b_and_c_parts(tp: int) -> None:
    x, groups = INTERMEDIATE // tp, N_GROUPS * STATE // tp
    for rank in range(tp):
        conv, ssm = state_shards(mamba2_spec(tp), tp, rank, N_GROUPS) or ()
        assert conv.shape == (INTERMEDIATE + 2 * N_GROUPS * STATE, KERNEL - 1)
        assert conv.runs == (
            (rank * x, x),
            (INTERMEDIATE + rank * groups, groups),
            (INTERMEDIATE + N_GROUPS * STATE + rank * groups, groups),
        )
        assert ssm.shape == (HEADS, HEAD_DIM, STATE)
        assert ssm.runs == ((rank * HEADS // tp, HEADS // tp),)


def test_state_groups_convert_with_known_splits() -> None:
    config = convert_kv_cache_config(
        kv_config(mamba2_spec(2)), fail_closed=True, vllm_config=vllm_config(2)
    )
    assert config.kv_cache_groups[0].kv_cache_spec == kv_cache.MambaSpec(
        MAX_MODEL_LEN, 0, state_splits=(0, 0)
    )
    assert config.transfer_group_ids == (0,)


@pytest.mark.parametrize("tp", [2, 4])
def test_state_partials_of_any_tp_size_add_up_to_one_ranks(tp: int) -> None:
    states = unsharded_states(seed=tp)

    def total(tp: int) -> tuple[int, set[int]]:
        value, fingerprints = 0, set()
        for rank in range(tp):
            layers = kv_layers(
                vllm_config(tp),
                kv_config(mamba2_spec(tp)),
                rank_pages(states, tp, rank),
                covered_groups={0},
                tp_rank=rank,
            )
            assert all(isinstance(layer, KVStateLayer) for layer in layers)
            assert [layer.index for layer in layers] == [0, 2]
            worker = KVChecksumWorker(layers, tp_rank=rank)
            assert worker.skipped_groups == frozenset()
            fingerprints.add(worker.fingerprints[0])
            value += state_value(worker, 3)
        return value % (1 << 64), fingerprints

    whole, whole_fingerprints = total(1)
    shared, shared_fingerprints = total(tp)
    assert shared == whole
    assert shared_fingerprints == whole_fingerprints


def test_a_flipped_bit_of_either_state_changes_the_value() -> None:
    states = unsharded_states(seed=7)
    pages = rank_pages(states, 1, 0)
    layers = kv_layers(
        vllm_config(1),
        kv_config(mamba2_spec(1)),
        pages,
        covered_groups={0},
        tp_rank=0,
    )
    worker = KVChecksumWorker(layers, tp_rank=0)
    clean = state_value(worker, 2)
    conv_bytes = mamba2_spec(1).shapes[0][0] * (KERNEL - 1) * 2
    for offset in (0, conv_bytes - 1, conv_bytes, conv_bytes + 100):
        page = pages[LAYERS[1]][2, 0, 0]
        page[offset] ^= 0x10
        assert state_value(worker, 2) != clean
        page[offset] ^= 0x10
    # The padding after the states is not state: not checksummed.
    pages[LAYERS[0]][2, 0, 0, -1] ^= 0x10
    assert state_value(worker, 2) == clean


def test_group_counts_tp_does_not_divide_leave_the_split_unknown() -> None:
    # vLLM replicates groups then: a share is not a slice of the state.
    spec = mamba2_spec(2, n_groups=1)
    assert state_shards(spec, 2, 0, 1) is None
    assert state_shards(spec, 2, 0, None) is None
    config = convert_kv_cache_config(
        kv_config(spec), fail_closed=True, vllm_config=vllm_config(2, n_groups=1)
    )
    assert config.kv_cache_groups[0].kv_cache_spec == kv_cache.MambaSpec(
        MAX_MODEL_LEN, 0, state_splits=None
    )
    # One rank of one TP size still checksums its share, tagged as such.
    layers = kv_layers(
        vllm_config(2, n_groups=1),
        kv_config(spec),
        {
            name: torch.zeros(
                (NUM_BLOCKS, 1, 1, spec.page_size_bytes), dtype=torch.int8
            )
            for name in LAYERS
        },
        covered_groups={0},
        tp_rank=1,
    )
    assert all(
        tensor.shard is None
        for layer in layers
        if isinstance(layer, KVStateLayer)
        for tensor in layer.states
    )


def test_the_sd_conv_layout_leaves_the_split_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mamba_utils, "get_conv_state_layout", lambda: "SD")
    assert state_shards(mamba2_spec(2), 2, 0, N_GROUPS) is None


def test_one_rank_needs_no_group_count_to_know_its_share() -> None:
    assert state_shards(mamba2_spec(1), 1, 0, None) is not None


@pytest.mark.parametrize(
    ("attrs", "n_groups"),
    [
        ({"mamba_n_groups": 0, "n_groups": 4}, 4),
        ({"mamba_n_groups": "4", "mamba_ngroups": 2}, 2),
        ({"n_groups": -1}, None),
        ({}, None),
    ],
)
def test_the_group_count_is_the_first_positive_count_the_model_names(
    attrs: dict[str, Any], n_groups: int | None
) -> None:
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**attrs))
    )
    assert model_n_groups(config) == n_groups  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "shapes"),
    [
        (MambaAttentionBackendEnum.SHORT_CONV, ((3, 64),)),
        (MambaAttentionBackendEnum.SHORT_CONV, ((3, 64), (8, 8, 16))),
        (MambaAttentionBackendEnum.MAMBA2, ((3, 64),)),
    ],
)
def test_state_kinds_connectors_do_not_move_whole_fail_closed(
    kind: MambaAttentionBackendEnum, shapes: tuple[tuple[int, ...], ...]
) -> None:
    spec = MambaSpec(
        block_size=MAX_MODEL_LEN,
        shapes=shapes,
        dtypes=(torch.bfloat16,) * len(shapes),
        mamba_type=kind,
    )
    with pytest.raises(UnsupportedKVCacheError, match="MambaSpec"):
        convert_kv_cache_config(kv_config(spec), fail_closed=True)


def test_fail_open_leaves_out_every_group_it_cannot_checksum_even_all() -> None:
    # The only transfer group is of a kind KVGuard cannot checksum: none is
    # covered (not every group, as "no groups given" means elsewhere).
    spec = MambaSpec(
        block_size=MAX_MODEL_LEN,
        shapes=((3, 64),),
        dtypes=(torch.bfloat16,),
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
    )
    config = convert_kv_cache_config(kv_config(spec), fail_closed=False)
    assert config.transfer_group_ids == ()
    # So a worker registers no layer of it (a short-conv state it would
    # fail to cut into states).
    pages = {
        name: torch.zeros(8, 1, 1, 3 * 64 * 2, dtype=torch.int8) for name in LAYERS
    }
    layers = kv_layers(
        vllm_config(1),
        kv_config(spec),
        pages,
        covered_groups=set(config.transfer_group_ids),
        tp_rank=0,
    )
    assert layers == []
