"""Two engines' checksum schedulers and workers over small torch KV caches,
with a simulated KV transfer that copies blocks to other block ids.

KV moves in a layout-free form, per attention group a uint8 array
``[layers, tokens, heads, cell_bytes]`` (a cell: K bytes then V bytes, as
``docs/checksum.md`` defines it), per state (Mamba2) group a uint8 array
``[layers, state_bytes]``: each layer's unsharded conv state then SSM state.
Each engine scatters it into its own workers' caches (its TP shards, PP
stages, block size, layout and block ids) and gathers it back.
Corruptions are applied to that form between the producer's read and the
consumer's write, or to a consumer cache directly.

State groups are laid out and moved as vLLM 0.32 and its NIXL connector do:
per layer one page per block holding the rank's share of the conv state
(``DS``: ``[conv_dim, kernel - 1]``, TP splitting its x, B and C parts) and
of the SSM state (``[heads, head_dim, d_state]``, TP splitting the heads);
a request's blocks are its running-state block, after null blocks in
"align" mode, and speculative scratch blocks; the transfer copies the
producer's running state (``clip_ssm_state_blocks``) into the consumer's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from kv_host_fakes import (
    FakeBlocks,
    FakeConnector,
    FakeConnectorOutput,
    FakeKVCacheManager,
    FakeRequest,
    consumer_request,
    producer_request,
)

from engine_patch.config import KVChecksumConfig
from engine_patch.host import CacheHitSource, FinishReason
from engine_patch.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    sliding_window_transfer_blocks,
)
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.types import KVChecksumBlocks, KVChecksumRecord
from engine_patch.worker import (
    KVChecksumWorker,
    KVLayer,
    KVLayout,
    KVStateLayer,
    StateShard,
    StateTensor,
    state_views,
)

# Per group: uint8 [layers of the group, tokens, KV heads, cell bytes], or
# for a state group [layers of the group, state bytes].
KV = dict[int, np.ndarray]
Worker = tuple[int, int]  # (pp_rank, tp_rank)


@dataclass(frozen=True)
class GroupShape:
    """A KV cache group of the model: its layers (model-wide indices)."""

    layers: tuple[int, ...]
    head_size: int = 4
    dtype: torch.dtype = torch.float16
    sliding_window: int | None = None

    @property
    def cell_bytes(self) -> int:
        return 2 * self.head_size * torch.empty(0, dtype=self.dtype).element_size()


# A state group's block size in vLLM's mamba_cache_mode "none": the model's
# length, one block per request.
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class StateSpec:
    """One state of a state layer, unsharded: its shape and dtype, the dim TP
    splits and that dim's separately split parts (None: one part)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    parts: tuple[int, ...] | None = None

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_size


@dataclass(frozen=True)
class StateGroupShape:
    """A state (Mamba2) group of the model: its layers (model-wide indices),
    each with a conv state and an SSM state.

    ``conv_layout`` is ``"DS"`` (``[conv_dim, kernel - 1]``, what NIXL's
    Mamba transfer needs) or ``"SD"``. ``known_split``: the scheduler's
    ``MambaSpec.state_splits`` and the workers' ``StateShard`` are set (else
    unknown: only peers of one TP size compare). ``tp_replicated``: every
    rank holds the whole state. ``cache_mode`` as vLLM's
    ``mamba_cache_mode``: ``"none"`` (one block per request) or ``"align"``
    (blocks of the engine's block size, null but the running state's).
    """

    layers: tuple[int, ...]
    num_heads: int = 8
    head_dim: int = 4
    n_groups: int = 4
    d_state: int = 4
    conv_kernel: int = 4
    conv_layout: Literal["DS", "SD"] = "DS"
    known_split: bool = True
    tp_replicated: bool = False
    cache_mode: Literal["none", "align"] = "none"
    num_speculative_blocks: int = 0
    # Bytes of a page past its states (vLLM pads state pages to the
    # attention page size).
    page_padding: int = 24

    @property
    def states(self) -> tuple[StateSpec, StateSpec]:
        """The conv state (TP splits x, B and C) and the SSM state (TP
        splits the heads)."""
        x = self.num_heads * self.head_dim
        bc = self.n_groups * self.d_state
        parts = (x, bc, bc)
        rows = self.conv_kernel - 1
        conv = (
            StateSpec((x + 2 * bc, rows), torch.bfloat16, 0, parts)
            if self.conv_layout == "DS"
            else StateSpec((rows, x + 2 * bc), torch.bfloat16, 1, parts)
        )
        ssm = StateSpec((self.num_heads, self.head_dim, self.d_state), torch.float32, 0)
        return conv, ssm

    @property
    def offsets(self) -> list[tuple[int, int]]:
        """Each state's ``(offset, bytes)`` in a layer's unsharded form."""
        out = []
        offset = 0
        for spec in self.states:
            out.append((offset, spec.nbytes))
            offset += spec.nbytes
        return out

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.states)


AnyGroupShape = GroupShape | StateGroupShape


@dataclass(frozen=True)
class ModelShape:
    """What both engines serve: KV heads and groups of layers."""

    num_kv_heads: int = 2
    groups: tuple[AnyGroupShape, ...] = (GroupShape(layers=(0, 1, 2, 3)),)

    @property
    def num_layers(self) -> int:
        return 1 + max(layer for group in self.groups for layer in group.layers)

    def random_kv(self, seed: int, num_tokens: int) -> KV:
        rng = np.random.default_rng(seed)
        return {
            g: rng.integers(
                0,
                256,
                (len(group.layers), group.nbytes)
                if isinstance(group, StateGroupShape)
                else (
                    len(group.layers),
                    num_tokens,
                    self.num_kv_heads,
                    group.cell_bytes,
                ),
                dtype=np.uint8,
            )
            for g, group in enumerate(self.groups)
        }

    def state_groups(self) -> list[int]:
        """The ids of its state groups."""
        return [
            g
            for g, group in enumerate(self.groups)
            if isinstance(group, StateGroupShape)
        ]


@dataclass
class _Cache:
    """One layer's KV on one worker."""

    layer: KVLayer
    group_id: int
    # The layer's position in its group (the KV form's first dim).
    slot: int
    heads: slice


@dataclass
class _StateCache:
    """One state layer's pages on one worker."""

    layer: KVStateLayer
    group_id: int
    # The layer's position in its group (the KV form's first dim).
    slot: int
    # uint8 [blocks, page]: the rank's share of each state, one after the
    # other, then padding.
    pages: np.ndarray
    # Where TP puts the rank's share of each state (whether or not the
    # workers are told).
    shards: tuple[StateShard, ...]


def _share(state: np.ndarray, shard: StateShard) -> np.ndarray:
    """A rank's share of an unsharded state (``[*shape, element bytes]``):
    its runs of the split dim, in order."""
    runs = shard.runs or ((0, shard.shape[shard.dim]),)
    return np.concatenate(
        [
            np.take(state, np.arange(start, start + length), axis=shard.dim)
            for start, length in runs
        ],
        axis=shard.dim,
    )


def _unshare(state: np.ndarray, shard: StateShard, share: np.ndarray) -> None:
    """Put a rank's share back into the unsharded ``state``."""
    runs = shard.runs or ((0, shard.shape[shard.dim]),)
    offset = 0
    for start, length in runs:
        into = [slice(None)] * state.ndim
        into[shard.dim] = slice(start, start + length)
        out = [slice(None)] * state.ndim
        out[shard.dim] = slice(offset, offset + length)
        state[tuple(into)] = share[tuple(out)]
        offset += length


@dataclass
class SimBlocks(FakeBlocks):
    """A request's blocks, and per state group the block its running state
    is in (what vLLM's connectors transfer) and earlier states' blocks not
    freed yet (a superseded state of a chunked prefill, a prefix hit's)."""

    states: dict[int, int] = field(default_factory=dict)
    decoys: dict[int, list[int]] = field(default_factory=dict)


def _cells(kv: torch.Tensor, layout: KVLayout) -> np.ndarray:
    """A byte view of the cache indexed ``[block, offset, head]``: each
    element a cell (SPLIT: its K and V bytes as ``[2, half]``).

    NumPy, not torch: one thread, so a busy machine does not stall the
    simulated copies on torch's intra-op thread pool.
    """
    u = kv.view(torch.uint8).numpy()
    if layout is KVLayout.SPLIT:
        return u.transpose(1, 2, 3, 0, 4)
    if layout is KVLayout.PACKED_HND:
        return u.transpose(0, 2, 1, 3)
    return u


class SimEngine:
    """One engine: its checksum scheduler and one checksum worker per (PP
    stage, TP rank), each over its own small KV caches."""

    def __init__(
        self,
        model: ModelShape,
        *,
        tp: int = 1,
        pp: int = 1,
        block_size: int = 16,
        num_blocks: int = 48,
        layout: KVLayout = KVLayout.SPLIT,
        fail_closed: bool = True,
        connector: FakeConnector | None = None,
        prefix_caching: bool = False,
        state_pages: Literal["per_layer", "shared"] = "per_layer",
        seed: int = 0,
    ) -> None:
        self.model = model
        self.state_pages = state_pages
        self.tp, self.pp = tp, pp
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.connector = connector or FakeConnector()
        self.kv_cache_config = KVCacheConfig(
            [
                KVCacheGroup(
                    self._spec(group),
                    tuple(_layer_name(group, i) for i in group.layers),
                )
                for group in model.groups
            ]
        )
        self.scheduler = KVChecksumScheduler(
            KVChecksumConfig(tp_size=tp, pp_size=pp, fail_closed=fail_closed),
            self.kv_cache_config,
            self.connector,
        )
        self.manager = FakeKVCacheManager()
        self.rng = np.random.default_rng(seed)
        # Block 0 is the null block; free ids per group.
        self._free = [list(range(1, num_blocks)) for _ in model.groups]
        # Prefix caching, like vLLM's: the full blocks of finished loads by
        # (prompt, block position), a block id per group, reused by later
        # requests with the prompt; cached blocks are never freed.
        assert not prefix_caching or all(
            isinstance(group, GroupShape) and group.sliding_window is None
            for group in model.groups
        ), "prefix caching of full-attention groups only"
        self.prefix_caching = prefix_caching
        self.cached: dict[tuple[str, int], list[int]] = {}
        self.caches: dict[Worker, list[_Cache]] = {}
        self.state_caches: dict[Worker, list[_StateCache]] = {}
        self.workers: dict[Worker, KVChecksumWorker] = {}
        for pp_rank, tp_rank in itertools.product(range(pp), range(tp)):
            caches = self._make_caches(pp_rank, tp_rank, layout)
            state_caches = self._make_state_caches(pp_rank, tp_rank)
            self.caches[pp_rank, tp_rank] = caches
            self.state_caches[pp_rank, tp_rank] = state_caches
            self.workers[pp_rank, tp_rank] = KVChecksumWorker(
                [c.layer for c in caches] + [c.layer for c in state_caches],
                tp_rank=tp_rank,
                pp_rank=pp_rank,
            )

    def _spec(self, group: AnyGroupShape) -> KVCacheSpec:
        """The scheduler's spec of a group of the model."""
        if isinstance(group, StateGroupShape):
            return MambaSpec(
                self.state_block_size(group),
                group.num_speculative_blocks,
                state_splits=tuple(spec.dim for spec in group.states)
                if group.known_split
                else None,
                tp_replicated=group.tp_replicated,
            )
        if group.sliding_window is None:
            return FullAttentionSpec(self.block_size)
        return SlidingWindowSpec(self.block_size, group.sliding_window)

    def state_block_size(self, group: StateGroupShape) -> int:
        """Tokens per block of a state group: the engine's block size in
        "align" mode, else the model's length (one block)."""
        return self.block_size if group.cache_mode == "align" else MAX_MODEL_LEN

    def _stage(self, pp_rank: int) -> range:
        """The layers of PP stage ``pp_rank``."""
        layers_per_stage = cdiv(self.model.num_layers, self.pp)
        return range(pp_rank * layers_per_stage, (pp_rank + 1) * layers_per_stage)

    def _make_state_caches(self, pp_rank: int, tp_rank: int) -> list[_StateCache]:
        """The rank's state layers: each layer's pages in its own int8 tensor,
        as vLLM allocates them (or, with ``state_pages="shared"``, all of a
        group's layers in one), its states cut out as vLLM's
        ``bind_kv_cache`` does."""
        stage = self._stage(pp_rank)
        caches = []
        for g, group in enumerate(self.model.groups):
            if not isinstance(group, StateGroupShape):
                continue
            slots = [
                (slot, index)
                for slot, index in enumerate(group.layers)
                if index in stage
            ]
            specs = group.states
            if group.tp_replicated:
                shards = tuple(StateShard(spec.shape, spec.dim) for spec in specs)
                replicas, replica_index = self.tp, tp_rank
            else:
                shards = tuple(
                    StateShard.split(spec.shape, spec.dim, self.tp, tp_rank, spec.parts)
                    for spec in specs
                )
                replicas, replica_index = 1, 0
            shapes = [shard.local_shape() for shard in shards]
            page = group.page_padding + sum(
                math.prod(shape) * spec.element_size
                for shape, spec in zip(shapes, specs, strict=True)
            )
            # NumPy-allocated: see _cells.
            shape = (len(slots), self.num_blocks, page)
            if self.state_pages == "shared":
                buffers = list(torch.from_numpy(np.zeros(shape, dtype=np.int8)))
            else:
                buffers = [
                    torch.from_numpy(np.zeros(shape[1:], dtype=np.int8)) for _ in slots
                ]
            for (slot, index), pages in zip(slots, buffers, strict=True):
                views = state_views(
                    pages[:, None, None, :], shapes, [spec.dtype for spec in specs]
                )
                layer = KVStateLayer(
                    name=_layer_name(group, index),
                    index=index,
                    group_id=g,
                    states=tuple(
                        StateTensor(view, shard if group.known_split else None)
                        for view, shard in zip(views, shards, strict=True)
                    ),
                    replicas=replicas,
                    replica_index=replica_index,
                )
                caches.append(
                    _StateCache(layer, g, slot, pages.view(torch.uint8).numpy(), shards)
                )
        return caches

    def _make_caches(
        self, pp_rank: int, tp_rank: int, layout: KVLayout
    ) -> list[_Cache]:
        model = self.model
        heads = model.num_kv_heads
        stage = self._stage(pp_rank)
        if self.tp <= heads:
            local = heads // self.tp
            head_offset, replicas, replica_index = tp_rank * local, 1, 0
        else:
            local, replicas = 1, self.tp // heads
            head_offset, replica_index = tp_rank // replicas, tp_rank % replicas
        caches = []
        for g, group in enumerate(model.groups):
            if isinstance(group, StateGroupShape):
                continue
            for slot, index in enumerate(group.layers):
                if index not in stage:
                    continue
                half = group.head_size
                shape = {
                    KVLayout.SPLIT: (2, self.num_blocks, self.block_size, local, half),
                    KVLayout.PACKED_NHD: (
                        self.num_blocks,
                        self.block_size,
                        local,
                        2 * half,
                    ),
                    KVLayout.PACKED_HND: (
                        self.num_blocks,
                        local,
                        self.block_size,
                        2 * half,
                    ),
                }[layout]
                kv = torch.zeros(shape, dtype=group.dtype)
                layer = KVLayer(
                    name=_layer_name(group, index),
                    index=index,
                    group_id=g,
                    kv=kv,
                    layout=layout,
                    spec_type="full_attention"
                    if group.sliding_window is None
                    else "sliding_window",
                    head_offset=head_offset,
                    replicas=replicas,
                    replica_index=replica_index,
                    total_num_kv_heads=heads,
                )
                caches.append(
                    _Cache(layer, g, slot, slice(head_offset, head_offset + local))
                )
        return caches

    # --- Blocks and KV ----------------------------------------------------------

    def allocate(
        self, req_id: str, num_tokens: int, cached: Sequence[list[int]] = ()
    ) -> SimBlocks:
        """Random free block ids for the request after its ``cached``
        prefix's blocks (a block id per group each); a sliding-window group's
        blocks out of its window are null; a state group's are its running
        state's (after null blocks in "align" mode, maybe one of an earlier
        state not freed yet) and speculative scratch blocks."""
        count = cdiv(num_tokens, self.block_size)
        groups: list[list[int | None]] = []
        states: dict[int, int] = {}
        decoys: dict[int, list[int]] = {}
        for g, (group, shape) in enumerate(
            zip(self.kv_cache_config.kv_cache_groups, self.model.groups, strict=True)
        ):
            if isinstance(shape, StateGroupShape):
                groups.append(
                    self._allocate_state(g, shape, num_tokens, states, decoys)
                )
                continue
            keep = sliding_window_transfer_blocks(group.kv_cache_spec) or count
            num_null = max(0, count - keep)
            prefix = [ids[g] for ids in cached]
            ids = self._take(g, count - num_null - len(prefix))
            groups.append([*[None] * num_null, *prefix, *ids])
        blocks = SimBlocks.of(*groups)
        blocks.states, blocks.decoys = states, decoys
        self.manager.by_request[req_id] = blocks
        return blocks

    def _take(self, g: int, count: int) -> list[int]:
        """``count`` random free block ids of group ``g``."""
        free = self._free[g]
        picked = self.rng.choice(len(free), count, replace=False)
        taken = set(picked.tolist())
        self._free[g] = [b for i, b in enumerate(free) if i not in taken]
        return [free[i] for i in picked]

    def _allocate_state(
        self,
        g: int,
        shape: StateGroupShape,
        num_tokens: int,
        states: dict[int, int],
        decoys: dict[int, list[int]],
    ) -> list[int | None]:
        """A state group's block table, as vLLM's ``MambaManager`` makes it."""
        count = cdiv(num_tokens, self.state_block_size(shape))
        state, *spec = self._take(g, 1 + shape.num_speculative_blocks)
        table: list[int | None] = [*[None] * (count - 1), state, *spec]
        states[g] = state
        decoys[g] = []
        if count > 1 and self.rng.random() < 0.5:
            # An earlier state still held: a chunked prefill's superseded one
            # (freed a step later) or a prefix hit's.
            (decoy,) = self._take(g, 1)
            table[int(self.rng.integers(count - 1))] = decoy
            decoys[g].append(decoy)
        return table

    def free(self, req_id: str) -> None:
        blocks = self.manager.by_request.pop(req_id)
        cached = [set(ids) for ids in zip(*self.cached.values(), strict=True)]
        for g, group in enumerate(blocks.blocks):
            self._free[g].extend(
                b.block_id
                for b in group
                if not b.is_null and not (cached and b.block_id in cached[g])
            )

    def cache_hit(self, prompt: str, num_tokens: int) -> list[list[int]]:
        """The cached blocks of the prompt's longest cached prefix of whole
        blocks, leaving a token to compute (as vLLM does)."""
        hit: list[list[int]] = []
        while len(hit) < (num_tokens - 1) // self.block_size and (
            ids := self.cached.get((prompt, len(hit)))
        ):
            hit.append(ids)
        return hit

    def cache(self, prompt: str, blocks: FakeBlocks, num_tokens: int) -> None:
        """Cache the request's whole blocks as the prompt's."""
        for position in range(num_tokens // self.block_size):
            self.cached.setdefault(
                (prompt, position),
                [group[position].block_id for group in blocks.blocks],
            )

    def _token_slots(
        self, blocks: FakeBlocks, g: int, start: int, end: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens in ``[start, end)`` whose block in group ``g`` is not
        null, and their block ids and offsets."""
        tokens = np.arange(start, end)
        table = np.array(
            [-1 if b.is_null else b.block_id for b in blocks.blocks[g]], dtype=np.int64
        )
        ids = table[tokens // self.block_size]
        live = ids >= 0
        return tokens[live], ids[live], tokens[live] % self.block_size

    def _slots(
        self, blocks: FakeBlocks, start: int, end: int
    ) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per attention group, ``_token_slots`` of ``[start, end)``."""
        return {
            g: self._token_slots(blocks, g, start, end)
            for g, group in enumerate(self.model.groups)
            if isinstance(group, GroupShape)
        }

    def write(
        self,
        blocks: SimBlocks,
        kv: KV,
        start: int,
        end: int,
        *,
        states: bool = True,
    ) -> None:
        """Scatter tokens ``[start, end)`` of ``kv`` (indexed from
        ``start``) into every worker's caches, and (if ``states``) each state
        group's state into its running-state block: the forward pass, or a
        load."""
        slots = self._slots(blocks, start, end)
        for caches in self.caches.values():
            for cache in caches:
                tokens, ids, offsets = slots[cache.group_id]
                data = kv[cache.group_id][cache.slot, tokens - start, cache.heads]
                view = _cells(cache.layer.kv, cache.layer.layout)
                view[ids, offsets] = data.reshape((len(ids), *view.shape[2:]))
        if states:
            for g, block in blocks.states.items():
                self.write_state(g, block, kv[g])

    def write_state(self, g: int, block: int, states: np.ndarray) -> None:
        """Write ``states`` (``[layers, state bytes]``, unsharded) of state
        group ``g`` into block ``block`` of every worker: each its share."""
        group = self.model.groups[g]
        assert isinstance(group, StateGroupShape)
        for caches in self.state_caches.values():
            for cache in caches:
                if cache.group_id != g:
                    continue
                offset = 0
                for (start, size), spec, shard in zip(
                    group.offsets, group.states, cache.shards, strict=True
                ):
                    state = states[cache.slot, start : start + size].reshape(
                        *spec.shape, spec.element_size
                    )
                    share = _share(state, shard).ravel()
                    cache.pages[block, offset : offset + share.size] = share
                    offset += share.size

    def read_state(self, g: int, block: int) -> np.ndarray:
        """State group ``g``'s states in block ``block``, unsharded, from
        the ranks holding replica 0: ``[layers, state bytes]``."""
        group = self.model.groups[g]
        assert isinstance(group, StateGroupShape)
        out = np.zeros((len(group.layers), group.nbytes), dtype=np.uint8)
        for caches in self.state_caches.values():
            for cache in caches:
                if cache.group_id != g or cache.layer.replica_index:
                    continue
                offset = 0
                for (start, size), spec, shard in zip(
                    group.offsets, group.states, cache.shards, strict=True
                ):
                    state = out[cache.slot, start : start + size].reshape(
                        *spec.shape, spec.element_size
                    )
                    local = (*shard.local_shape(), spec.element_size)
                    share_size = math.prod(local)
                    share = cache.pages[block, offset : offset + share_size]
                    _unshare(state, shard, share.reshape(local))
                    offset += share_size
        return out

    def read(self, blocks: SimBlocks, start: int, end: int) -> KV:
        """Gather tokens ``[start, end)`` back (zeros where a block is null),
        from the ranks holding replica 0, and each state group's running
        state."""
        out = {
            g: np.zeros(
                (
                    len(group.layers),
                    end - start,
                    self.model.num_kv_heads,
                    group.cell_bytes,
                ),
                dtype=np.uint8,
            )
            for g, group in enumerate(self.model.groups)
            if isinstance(group, GroupShape)
        }
        slots = self._slots(blocks, start, end)
        for caches in self.caches.values():
            for cache in caches:
                if cache.layer.replica_index:
                    continue
                tokens, ids, offsets = slots[cache.group_id]
                cells = _cells(cache.layer.kv, cache.layer.layout)[ids, offsets]
                out[cache.group_id][cache.slot, tokens - start, cache.heads] = (
                    cells.reshape(len(ids), cells.shape[1], -1)
                )
        for g, block in blocks.states.items():
            out[g] = self.read_state(g, block)
        return dict(sorted(out.items()))

    # --- Steps ------------------------------------------------------------------

    def step(
        self,
        *,
        finished_loads: Sequence[str] = (),
        stored: Mapping[Worker, Mapping[int, np.ndarray]] | None = None,
        load: Callable[[], None] | None = None,
        skip_req_ids: set[str] | None = None,
        ranks: Sequence[Worker] | None = None,
    ) -> set[str]:
        """One engine step: the workers take the scheduled checksums, ``load``
        writes loaded KV, sends are checksummed after the forward, the
        finished loads when they finish; the scheduler takes the records
        (of ``ranks`` only, if given). Returns the failed loads."""
        scheduled = self.scheduler.build_checksum_meta()
        for worker in self.workers.values():
            worker.begin_step(scheduled)
        if load is not None:
            load()
        records: list[KVChecksumRecord] = []
        for rank, worker in self.workers.items():
            worker.after_forward()
            if stored is not None:
                for req_id in finished_loads:
                    worker.set_stored(req_id, stored[rank])
            worker.on_loads_finished(finished_loads)
            record = worker.take_record()
            if record is not None and (ranks is None or rank in ranks):
                records.append(record)
        return self.scheduler.update_from_output(
            FakeConnectorOutput(records, set(finished_loads)), skip_req_ids or set()
        )

    def finish(
        self, req: FakeRequest, reason: FinishReason = FinishReason.STOP
    ) -> dict[str, object]:
        """The request finishes: the kv_transfer_params it returns."""
        req.finish_reason = reason
        params: dict[str, object] = {"do_remote_prefill": True}
        self.scheduler.request_finished(req, params)
        for worker in self.workers.values():
            worker.request_finished([req.request_id])
        return params

    def random_state(self, g: int) -> np.ndarray:
        """Random states of state group ``g``, ``[layers, state bytes]``."""
        group = self.model.groups[g]
        assert isinstance(group, StateGroupShape)
        return self.rng.integers(
            0, 256, (len(group.layers), group.nbytes), dtype=np.uint8
        )

    # --- Producer and consumer ----------------------------------------------------

    def prefill(
        self, req_id: str, kv: KV, num_tokens: int
    ) -> tuple[FakeRequest, SimBlocks]:
        """A producer request's prefill, in one step."""
        ((req, blocks),) = self.prefill_together([(req_id, kv, num_tokens)])
        return req, blocks

    def prefill_together(
        self, prompts: Sequence[tuple[str, KV, int]]
    ) -> list[tuple[FakeRequest, SimBlocks]]:
        """Producer requests ``(req_id, kv, num_tokens)`` prefilled in one
        step (an earlier state still held holds another state)."""
        out = []
        for req_id, kv, num_tokens in prompts:
            req = producer_request(req_id, num_tokens)
            blocks = self.allocate(req_id, num_tokens)
            req.num_computed_tokens = num_tokens
            self.write(blocks, kv, 0, num_tokens)
            for g, decoys in blocks.decoys.items():
                for block in decoys:
                    self.write_state(g, block, self.random_state(g))
            self.scheduler.add_send(req, num_tokens, self.manager)
            out.append((req, blocks))
        assert self.step() == set()
        return out


Corruption = Callable[[KV], None]


@dataclass
class Transfer:
    """A P/D transfer of one request from ``producer`` to ``consumer``."""

    producer: SimEngine
    consumer: SimEngine
    num_tokens: int
    kv: KV
    req_id: str = "req"
    # The prompt's identity, for the consumer's prefix cache.
    prompt: str = ""
    producer_blocks: SimBlocks = field(init=False)
    # The consumer's blocks, from the start of its load.
    consumer_blocks: SimBlocks = field(init=False)
    params: dict[str, object] = field(init=False)
    # After the load: the tokens the consumer had cached, and the KV its
    # caches hold for the request (what it decodes from).
    num_cached_tokens: int = field(init=False, default=0)
    seen: KV = field(init=False, default_factory=dict)

    def load(
        self,
        *,
        params: Mapping[str, object] | None = None,
        num_local_tokens: int = 0,
        corrupt: Corruption | None = None,
        corrupt_cache: Callable[[SimEngine, SimBlocks], None] | None = None,
        ranks: Sequence[Worker] | None = None,
    ) -> set[str]:
        """The consumer loads the request's KV past its ``num_local_tokens``
        cached ones (with ``corrupt`` applied to what is transferred, or
        ``corrupt_cache`` to its caches after the copy) and verifies it: the
        failed loads.

        With prefix caching the consumer's cache hit is the cached prefix,
        whatever those blocks hold, and afterwards the load's blocks are
        cached unless it failed or mismatched
        (``KVChecksumScheduler.take_mismatched_loads``).
        """
        req = self.start_load(params, num_local_tokens)
        failed = self.consumer.step(
            finished_loads=[self.req_id],
            load=lambda: self.copy(corrupt, corrupt_cache),
            ranks=ranks,
        )
        self.finish_load(req, failed, self.consumer.scheduler.take_mismatched_loads())
        return failed

    def start_load(
        self, params: Mapping[str, object] | None = None, num_local_tokens: int = 0
    ) -> FakeRequest:
        """The consumer request arrives and its load starts (scheduled for
        the next step): its request."""
        consumer = self.consumer
        req = consumer_request(
            self.req_id, self.num_tokens, self.params if params is None else params
        )
        consumer.scheduler.on_new_request(req)
        hit = consumer.cache_hit(self.prompt, self.num_tokens)
        blocks = consumer.allocate(self.req_id, self.num_tokens, hit)
        self.consumer_blocks = blocks
        if hit:
            num_local_tokens = len(hit) * consumer.block_size
        elif num_local_tokens:
            # The cached prefix holds the same KV, computed locally; the
            # running state is loaded whatever the prefix.
            consumer.write(blocks, self.kv, 0, num_local_tokens, states=False)
        self.num_cached_tokens = num_local_tokens
        req.num_computed_tokens = self.num_tokens
        consumer.scheduler.add_recv(req, blocks, num_local_tokens)
        return req

    def copy(
        self,
        corrupt: Corruption | None = None,
        corrupt_cache: Callable[[SimEngine, SimBlocks], None] | None = None,
    ) -> None:
        """The transfer: the producer's KV past the consumer's cached tokens
        into the consumer's blocks."""
        data = self.producer.read(
            self.producer_blocks, self.num_cached_tokens, self.num_tokens
        )
        if corrupt is not None:
            corrupt(data)
        self.consumer.write(
            self.consumer_blocks, data, self.num_cached_tokens, self.num_tokens
        )
        if corrupt_cache is not None:
            corrupt_cache(self.consumer, self.consumer_blocks)

    def finish_load(
        self,
        req: FakeRequest,
        failed: set[str],
        mismatched: Mapping[str, object],
    ) -> None:
        """After the verifying step: what the consumer holds, its prefix
        cache, and both requests finished."""
        consumer = self.consumer
        self.seen = consumer.read(self.consumer_blocks, 0, self.num_tokens)
        if consumer.prefix_caching and self.req_id not in set(failed) | set(mismatched):
            consumer.cache(self.prompt, self.consumer_blocks, self.num_tokens)
        consumer.finish(req)
        consumer.free(self.req_id)
        self.producer.free(self.req_id)


def load_together(
    transfers: Sequence[Transfer],
    corrupt: Mapping[str, Corruption] | None = None,
    num_local_tokens: Mapping[str, int] | None = None,
) -> tuple[set[str], dict[str, dict[int, list[int]]]]:
    """The consumer loads several prefilled transfers (one consumer) in one
    step, ``corrupt[req_id]`` applied to a request's and past its
    ``num_local_tokens[req_id]`` cached ones: the failed and the mismatched
    loads."""
    (consumer,) = {id(t.consumer): t.consumer for t in transfers}.values()
    local = num_local_tokens or {}
    reqs = [t.start_load(num_local_tokens=local.get(t.req_id, 0)) for t in transfers]

    def copy() -> None:
        for t in transfers:
            t.copy((corrupt or {}).get(t.req_id))

    failed = consumer.step(finished_loads=[t.req_id for t in transfers], load=copy)
    mismatched = consumer.scheduler.take_mismatched_loads()
    for t, req in zip(transfers, reqs, strict=True):
        t.finish_load(req, failed, mismatched)
    return failed, mismatched


def transfer(
    producer: SimEngine,
    consumer: SimEngine,
    num_tokens: int,
    *,
    seed: int = 0,
    req_id: str = "req",
) -> Transfer:
    """A prefilled transfer of random KV (the prompt ``seed``'s)."""
    (t,) = transfers_together(producer, consumer, [(req_id, num_tokens, seed)])
    return t


def transfers_together(
    producer: SimEngine,
    consumer: SimEngine,
    requests: Sequence[tuple[str, int, int]],
) -> list[Transfer]:
    """Transfers of requests ``(req_id, num_tokens, seed)`` of random KV (the
    prompt ``seed``'s), prefilled in one step."""
    out = [
        Transfer(
            producer,
            consumer,
            num_tokens,
            producer.model.random_kv(seed, num_tokens),
            req_id,
            prompt=f"seed{seed}",
        )
        for req_id, num_tokens, seed in requests
    ]
    prefilled = producer.prefill_together([(t.req_id, t.kv, t.num_tokens) for t in out])
    for t, (req, blocks) in zip(out, prefilled, strict=True):
        t.producer_blocks = blocks
        t.params = producer.finish(req)
    return out


# --- Offloading -------------------------------------------------------------------


def offload_engine(model: ModelShape, **kwargs: object) -> SimEngine:
    """An engine whose connector loads from an offload tier that stores
    checksums with the KV."""
    connector = FakeConnector(
        sources={CacheHitSource.OFFLOAD: 1},
        checksum_sources=frozenset({CacheHitSource.OFFLOAD}),
    )
    return SimEngine(model, connector=connector, **kwargs)  # type: ignore[arg-type]


@dataclass
class Offloaded:
    """A request's full blocks in the offload tier: their KV and, per
    worker, the checksums stored with them."""

    kv: KV
    num_tokens: int
    block_hashes: list[bytes]
    stored: dict[Worker, dict[int, np.ndarray]]


def block_hashes(num_blocks: int, salt: str = "") -> list[bytes]:
    return [f"{salt}block{i}".encode() for i in range(num_blocks)]


def offload(engine: SimEngine, req_id: str, kv: KV, num_tokens: int) -> Offloaded:
    """Prefill a request and offload its full blocks with their checksums
    (attention groups only)."""
    assert not engine.model.state_groups(), "offloading of attention groups only"
    req = FakeRequest(req_id, num_prompt_tokens=num_tokens)
    blocks = engine.allocate(req_id, num_tokens)
    engine.write(blocks, kv, 0, num_tokens)
    num_full = num_tokens // engine.block_size
    hashes = block_hashes(num_full)
    checksum_blocks = KVChecksumBlocks(
        num_full * engine.block_size,
        {
            g: (0, [b.block_id for b in group[:num_full]])
            for g, group in enumerate(blocks.blocks)
        },
    )
    stored = {
        rank: worker.init_block_checksums(
            checksum_blocks, {g: hashes for g in checksum_blocks.groups}
        )
        for rank, worker in engine.workers.items()
    }
    engine.finish(req)
    engine.free(req_id)
    full = num_full * engine.block_size
    return Offloaded(
        {g: t[:, :full].copy() for g, t in kv.items()}, full, hashes, stored
    )


def reload(
    engine: SimEngine,
    req_id: str,
    offloaded: Offloaded,
    *,
    corrupt: Corruption | None = None,
    stored: Mapping[Worker, Mapping[int, np.ndarray]] | None = None,
) -> set[str]:
    """A new request with the offloaded prefix loads it back into other
    blocks (``corrupt`` applied to the KV read from the tier; ``stored`` in
    place of the stored checksums): the failed loads."""
    num_tokens = offloaded.num_tokens
    req = FakeRequest(
        req_id, num_prompt_tokens=num_tokens + 1, block_hashes=offloaded.block_hashes
    )
    blocks = engine.allocate(req_id, num_tokens + 1)
    req.num_computed_tokens = num_tokens
    engine.scheduler.add_recv(req, blocks, 0)
    data = {g: t.copy() for g, t in offloaded.kv.items()}
    if corrupt is not None:
        corrupt(data)
    failed = engine.step(
        finished_loads=[req_id],
        stored=offloaded.stored if stored is None else stored,
        load=lambda: engine.write(blocks, data, 0, num_tokens),
    )
    engine.finish(req)
    engine.free(req_id)
    return failed


def _layer_name(group: AnyGroupShape, index: int) -> str:
    if isinstance(group, StateGroupShape):
        return f"model.layers.{index}.mixer"
    return f"model.layers.{index}.self_attn.attn"


__all__ = [
    "KV_TRANSFER_PARAMS_KEY",
    "MAX_MODEL_LEN",
    "GroupShape",
    "ModelShape",
    "Offloaded",
    "SimBlocks",
    "SimEngine",
    "StateGroupShape",
    "StateSpec",
    "Transfer",
    "block_hashes",
    "load_together",
    "offload",
    "offload_engine",
    "reload",
    "transfer",
    "transfers_together",
]
