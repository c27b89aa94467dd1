"""Helpers of the worker tests: KV tensors in every layout and dtype, layers
over one buffer, batched loads, and Mamba2 state layers sharded over TP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumScheduled,
)
from engine_patch.worker import (
    KVChecksumWorker,
    KVLayer,
    KVLayout,
    KVStateLayer,
    StateShard,
    StateTensor,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.uint8,
    torch.float8_e4m3fn,
]
LAYOUTS = list(KVLayout)


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs and all: checksums read bytes)."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    *lead, last = shape
    raw = torch.randint(0, 256, (*lead, last * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def logical_shape(
    layout: KVLayout, num_blocks: int, block_size: int, heads: int, last: int
) -> tuple[int, ...]:
    if layout is KVLayout.SPLIT:
        return (2, num_blocks, block_size, heads, last)
    if layout is KVLayout.PACKED_HND:
        return (num_blocks, heads, block_size, last)
    return (num_blocks, block_size, heads, last)


def make_kv(
    layout: KVLayout,
    dtype: torch.dtype,
    view: str,
    *,
    num_blocks: int = 8,
    block_size: int = 4,
    heads: int = 2,
    last: int = 8,
    seed: int = 0,
) -> torch.Tensor:
    """A KV tensor of ``layout``: contiguous, a strided view into a buffer
    shared with other layers (FlashInfer's K/V-inner order, HND over NHD
    memory), or with a strided last dim."""
    shape = logical_shape(layout, num_blocks, block_size, heads, last)
    if view == "contiguous":
        kv = random_tensor(shape, dtype, seed)
    elif view == "shared_buffer":
        if layout is KVLayout.SPLIT:
            # [blocks, layers, 2, block_size, heads, head_size], layer 1.
            buf = random_tensor(
                (num_blocks, 3, 2, block_size, heads, last), dtype, seed
            )
            kv = buf[:, 1].transpose(0, 1)
        else:
            # The other packed order in memory, behind another layer's.
            a, b = (
                (heads, block_size)
                if layout is KVLayout.PACKED_NHD
                else (block_size, heads)
            )
            buf = random_tensor((2, num_blocks, a, b, last), dtype, seed)
            kv = buf[1].permute(0, 2, 1, 3)
        assert not kv.is_contiguous()
    else:
        buf = random_tensor((*shape[:-1], 2 * last), dtype, seed)
        kv = buf[..., ::2]
        assert kv.stride(-1) == 2
    assert kv.shape == shape
    return kv


def column_sums(group: KVChecksumGroup) -> list[int]:
    return [int(v) for v in group.values.sum(axis=1, dtype=np.uint64)]


def layers_in_one_buffer(
    layout: KVLayout,
    dtype: torch.dtype,
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 4,
    heads: int = 2,
    last: int = 8,
    block_major: bool = False,
    group_id: int = 0,
    spec_type: str = "full_attention",
    first_index: int = 0,
    seed: int = 0,
) -> list[KVLayer]:
    """Layers that are views of one allocation, as vLLM 0.32 and the fake
    engine lay them out: layer-major (``[layers, ...]``) or block-major
    (each block holds every layer's page)."""
    shape = logical_shape(layout, num_blocks, block_size, heads, last)
    if block_major and layout is not KVLayout.SPLIT:
        buf = random_tensor((num_blocks, num_layers, *shape[1:]), dtype, seed)
        views = [buf[:, i] for i in range(num_layers)]
    elif block_major:
        buf = random_tensor((num_blocks, num_layers, 2, *shape[2:]), dtype, seed)
        views = [buf[:, i].transpose(0, 1) for i in range(num_layers)]
    else:
        buf = random_tensor((num_layers, *shape), dtype, seed)
        views = [buf[i] for i in range(num_layers)]
    return [
        KVLayer(
            f"model.layers.{first_index + i}.attn",
            first_index + i,
            group_id,
            view,
            layout,
            spec_type=spec_type,
            head_offset=2,
        )
        for i, view in enumerate(views)
    ]


# (req_id, num_tokens, start, block ids): one block partly filled, several
# full ones, blocks past num_tokens, a request with no live block, and two
# requests sharing blocks (a prefix).
MIXED_REQUESTS = [
    ("one", 3, 0, [7]),
    ("many", 6 * 4, 0, [0, 5, 9, 2, 11, 4]),
    ("tail", 2 * 4 + 1, 1, [3, 8, 10]),
    ("empty", 4, 1, [6]),
    ("prefix", 9, 0, [0, 5, 1]),
]


def recv_all(
    worker: KVChecksumWorker,
    requests: list[tuple[str, int, dict[int, tuple[int, list[int]]]]],
) -> dict[str, dict[int, np.ndarray]]:
    """Load every request in one step: per request and group, its values."""
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_recv={
                req_id: KVChecksumBlocks(num_tokens, groups)
                for req_id, num_tokens, groups in requests
            }
        )
    )
    worker.on_loads_finished([req_id for req_id, _, _ in requests])
    record = worker.take_record()
    assert record is not None
    return {
        req_id: {group_id: group.values for group_id, group in groups.items()}
        for req_id, groups in record.checksums.items()
    }


NUM_BLOCKS = 6
# Mamba2: intermediate 64, 2 groups of state 16, 8 heads of 8, conv kernel 4.
INTERMEDIATE, GROUPS, STATE, HEADS, HEAD_DIM, CONV = 64, 2, 16, 8, 8, 4
CONV_DIM = INTERMEDIATE + 2 * GROUPS * STATE
# TP splits the conv dim's x, B and C parts separately.
CONV_PARTS = (INTERMEDIATE, GROUPS * STATE, GROUPS * STATE)


@dataclass
class StateSpec:
    """One state of a layer, unsharded: its shape, dtype and TP split."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    parts: tuple[int, ...] | None = None


def mamba2_states(conv_layout: str) -> list[StateSpec]:
    """Mamba2's conv state (``DS``: dim first, as vLLM's CPU backend needs;
    ``SD``: state_len first) and SSM state."""
    conv = (
        StateSpec((CONV_DIM, CONV - 1), torch.bfloat16, 0, CONV_PARTS)
        if conv_layout == "DS"
        else StateSpec((CONV - 1, CONV_DIM), torch.bfloat16, 1, CONV_PARTS)
    )
    return [conv, StateSpec((HEADS, HEAD_DIM, STATE), torch.float32, 0)]


def unsharded(
    specs: list[StateSpec], num_layers: int, seed: int
) -> list[list[torch.Tensor]]:
    """Per layer and state, random ``[blocks, *shape]`` states."""
    return [
        [
            random_tensor((NUM_BLOCKS, *spec.shape), spec.dtype, seed + 10 * layer + s)
            for s, spec in enumerate(specs)
        ]
        for layer in range(num_layers)
    ]


def share(state: torch.Tensor, shard: StateShard) -> torch.Tensor:
    """A rank's share of ``[blocks, *shape]`` states: its runs of the split
    dim, in order."""
    dim = shard.dim + 1
    return torch.cat(
        [state.narrow(dim, start, length) for start, length in shard.runs], dim=dim
    )


def rank_layers(
    specs: list[StateSpec],
    states: list[list[torch.Tensor]],
    tp: int,
    rank: int,
    *,
    group_id: int = 0,
    first_index: int = 0,
    known_split: bool = True,
    padded_page: int = 16,
) -> list[KVStateLayer]:
    """One rank's state layers: each layer's shares packed into one page per
    block, pages of every layer in one int8 buffer (vLLM's layout, pages
    padded by ``padded_page`` bytes), typed views cut as ``bind_kv_cache``
    does."""
    shards = [
        StateShard.split(spec.shape, spec.dim, tp, rank, spec.parts) for spec in specs
    ]
    sizes = [
        math.prod(shard.local_shape()) * torch.empty(0, dtype=spec.dtype).element_size()
        for spec, shard in zip(specs, shards, strict=True)
    ]
    page = sum(sizes) + padded_page
    buf = torch.zeros((len(states), NUM_BLOCKS, page), dtype=torch.int8)
    layers = []
    for index, layer_states in enumerate(states):
        offset = 0
        tensors = []
        for spec, shard, size, state in zip(
            specs, shards, sizes, layer_states, strict=True
        ):
            view = (
                buf[index, :, offset : offset + size]
                .view(spec.dtype)
                .view(NUM_BLOCKS, *shard.local_shape())
            )
            view.copy_(share(state, shard))
            tensors.append(StateTensor(view, shard if known_split else None))
            offset += size
        layers.append(
            KVStateLayer(
                f"model.layers.{first_index + index}.mixer",
                first_index + index,
                group_id,
                tuple(tensors),
            )
        )
    return layers


def state_values(
    worker: KVChecksumWorker, block_ids: dict[str, int], *, group_id: int = 0
) -> dict[str, np.ndarray]:
    """Per request, its state group's values after a load of its state
    block, all in one step."""
    worker.begin_step(
        KVChecksumScheduled(
            reqs_to_recv={
                req_id: KVChecksumBlocks(37, {group_id: (0, [block])})
                for req_id, block in block_ids.items()
            }
        )
    )
    worker.on_loads_finished(list(block_ids))
    record = worker.take_record()
    assert record is not None
    return {
        req_id: groups[group_id].values for req_id, groups in record.checksums.items()
    }
