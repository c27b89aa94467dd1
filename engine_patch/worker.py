"""Worker-side KV checksums (torch): the partial checksums of ``docs/checksum.md``
over the KV tensors (and state tensors) one TP rank of one PP stage holds.

The host engine's worker (vLLM's worker-side connector, the fake engine's
simulated TP workers) drives it once per step::

    worker = KVChecksumWorker(layers, tp_rank=r, pp_rank=s)
    worker.begin_step(scheduled)   # the scheduler's KVChecksumScheduled, or None
    ...forward pass writes KV...
    worker.after_forward()         # checksums this step's sends
    worker.on_loads_finished(ids)  # checksums finished recvs/loads, before
                                   # any later step can write their blocks
    record = worker.take_record()  # KVChecksumRecord for the scheduler, or None

Each of ``after_forward`` and ``on_loads_finished`` is one pass: every block
of every layer of every request it covers is gathered, mixed, weighted and
summed together (in chunks that bound memory), then scattered into the
requests' values; a pass costs a few dozen torch ops whatever its number of
requests and layers.

On CUDA nothing in a step waits for the device: the checksums are computed
on the current stream, copied to pinned host memory on a side stream, and
``take_record`` waits for that copy.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_patch import aot_kernel, checksum_kernel
from engine_patch.hashing import (
    block_checksum_tags,
    hash64,
    layer_fingerprint,
    layer_head_weight,
    piece_weight,
    position_weights,
)
from engine_patch.kv_cache import cdiv, checksum_tokens
from engine_patch.log import get_logger
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
    ReplicaKey,
)

logger = get_logger(__name__)

# Eager kernels on a CPU gather this many bytes per pass, so that their
# dozen passes over it stay in the core's cache.
_EAGER_CPU_CHUNK_BYTES = 1 << 20

# The integer dtype of each element size: viewing KV as it keeps its bytes.
_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class KVLayout(enum.Enum):
    """How a layer's KV tensor is laid out (any strides: views are fine)."""

    # [2, num_blocks, block_size, heads, head_size]: K then V.
    SPLIT = "split"
    # [num_blocks, heads, block_size, K+V]: K then V in the last dim.
    PACKED_HND = "packed_hnd"
    # [num_blocks, block_size, heads, K+V]: K then V in the last dim.
    PACKED_NHD = "packed_nhd"


@dataclass(frozen=True)
class KVLayer:
    """One attention layer's KV cache on this worker.

    ``index`` is the model-wide layer number and ``head_offset`` the global
    index of this rank's first KV head, so partial checksums of TP shards and
    PP stages add up. ``replicas``/``replica_index`` say which copy this rank
    holds when TP exceeds the KV heads (GQA) or the layer is replicated
    (MLA: one latent "head", ``replicas = tp_size``). Layers whose ``kv`` is
    the same tensor (shared KV cache) are counted once.
    ``total_num_kv_heads`` is the model's KV head count across all TP ranks
    (vLLM's ``model_config.get_total_num_kv_heads()``), part of the layer's
    fingerprint: sums of models with other head counts are not compared.
    Hosts fill it; None leaves it unknown.
    """

    name: str
    index: int
    group_id: int
    kv: torch.Tensor
    layout: KVLayout
    spec_type: str = "full_attention"
    head_offset: int = 0
    replicas: int = 1
    replica_index: int = 0
    total_num_kv_heads: int | None = None


@dataclass(frozen=True)
class StateShard:
    """Where one rank's share of a state tensor sits in the unsharded state
    (one block's state).

    ``shape`` is the unsharded state's shape. TP splits its dim ``dim``: the
    rank holds the indices ``runs`` of that dim, ``(start, length)`` pairs in
    the rank's own order (``()``: the whole dim). One run for an even split;
    one per part for a state that concatenates separately split parts, like
    Mamba2's conv state (x, B, C): see :meth:`split`.
    """

    shape: tuple[int, ...]
    dim: int = 0
    runs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def split(
        cls,
        shape: Sequence[int],
        dim: int,
        tp_size: int,
        tp_rank: int,
        parts: Sequence[int] | None = None,
    ) -> StateShard:
        """Rank ``tp_rank``'s share when TP splits each part of dim ``dim``
        (sizes ``parts`` along it, in order; default the whole dim) evenly
        over ``tp_size`` ranks.

        Raises:
            ValueError: If a part does not split evenly.
        """
        sizes = list(parts) if parts is not None else [shape[dim]]
        if sum(sizes) != shape[dim] or any(size % tp_size for size in sizes):
            raise ValueError(
                f"parts {sizes} of dim {dim} of {tuple(shape)} do not split "
                f"evenly over {tp_size} ranks"
            )
        runs = []
        start = 0
        for size in sizes:
            share = size // tp_size
            runs.append((start + tp_rank * share, share))
            start += size
        return cls(tuple(shape), dim, tuple(runs))

    def local_shape(self) -> tuple[int, ...]:
        """The shape of the rank's share."""
        shape = list(self.shape)
        if self.runs:
            shape[self.dim] = sum(length for _, length in self.runs)
        return tuple(shape)


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a state layer on this worker (e.g. Mamba's conv
    or SSM state): ``state[block]`` is one block's state, any strides.

    ``shard`` places the rank's share in the unsharded state, so that the
    partial checksums of TP ranks add up whatever the TP size; None when
    unknown: the unsharded state is then taken as the ranks' shares one after
    the other, which only a peer of the same TP size shares.
    """

    state: torch.Tensor
    shard: StateShard | None = None


@dataclass(frozen=True)
class KVStateLayer:
    """One state layer (Mamba) on this worker: a running state per request,
    checksummed as one value at position 0 (``docs/checksum.md``, "State
    groups (Mamba)").

    A state's 8-byte pieces are weighted by their offset in the unsharded
    state and ``S(index, s)`` for the state's number ``s`` in ``states``;
    a state whose bytes are not whole pieces is zero-padded at its end.
    ``replicas``/``replica_index`` as :class:`KVLayer`'s (``replicas =
    tp_size`` for states every rank holds whole).
    """

    name: str
    index: int
    group_id: int
    states: tuple[StateTensor, ...]
    spec_type: str = "mamba"
    replicas: int = 1
    replica_index: int = 0


AnyLayer = KVLayer | KVStateLayer


def state_views(
    pages: torch.Tensor,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """A state layer's states, cut out of its pages as vLLM 0.32's
    ``MambaBase.bind_kv_cache`` cuts them: ``pages`` has one page per block
    (a 1-byte dtype, ``[blocks, ..., bytes]``: vLLM's ``[blocks, 1, 1, C]``),
    each page the states one after the other; state ``i`` is ``[blocks,
    *shapes[i]]`` of ``dtypes[i]``.

    Raises:
        ValueError: If the states do not fit in a page.
    """
    pages = pages.flatten(1)
    states = []
    offset = 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if offset + size > pages.shape[1]:
            raise ValueError(
                f"states of {size} bytes from byte {offset} do not fit in pages "
                f"of {pages.shape[1]} bytes"
            )
        states.append(pages[:, offset : offset + size].view(dtype).view(-1, *shape))
        offset += size
    return states


@dataclass(frozen=True)
class _Shape:
    """A layer's KV tensor in the definition's terms."""

    num_blocks: int
    block_size: int
    heads: int
    # Elements of K (and of V) per cell in SPLIT, of K+V in packed layouts.
    head_elems: int
    cell_bytes: int


def _shape(kv: torch.Tensor, layout: KVLayout) -> _Shape:
    """Raises: ValueError: If ``kv``'s dims do not fit ``layout``."""
    size = kv.element_size()
    if layout is KVLayout.SPLIT:
        if kv.dim() != 5 or kv.shape[0] != 2:
            raise ValueError(
                f"a SPLIT KV tensor is [2, blocks, block_size, heads, head_size], "
                f"not {list(kv.shape)}"
            )
        _, num_blocks, block_size, heads, head_size = kv.shape
        return _Shape(num_blocks, block_size, heads, head_size, 2 * head_size * size)
    if kv.dim() != 4:
        raise ValueError(f"a {layout.name} KV tensor has 4 dims, not {list(kv.shape)}")
    if layout is KVLayout.PACKED_HND:
        num_blocks, heads, block_size, cell = kv.shape
    else:
        num_blocks, block_size, heads, cell = kv.shape
    return _Shape(num_blocks, block_size, heads, cell, cell * size)


# --- Sources: the tensors one gather reads -----------------------------------


@dataclass(frozen=True)
class _Member:
    """One layer (or one state of a state layer) of a source."""

    key: ReplicaKey
    # Its block 0's row in the source's rows.
    first_row: int
    # Its row of the source's head weights.
    weight_row: int


@dataclass
class _Source:
    """Same-shaped tensors of one group on one storage: one gather reads any
    of their blocks, as rows of ``rows``.

    A row is one block of one member: int64 pieces with the dims
    ``[parts, tokens, heads, pieces]`` at positions ``dims`` (memory order,
    so a gather copies whole runs) when ``to_pieces`` is None; else its
    elements, which ``to_pieces`` turns into pieces (dims in that order)
    once gathered.
    """

    rows: torch.Tensor
    members: list[_Member]
    # Rows between a member's consecutive blocks.
    block_rows: int
    num_blocks: int
    dims: tuple[int, int, int, int]
    # Q(p), shaped to broadcast over a row's pieces.
    piece_weights: torch.Tensor
    # S(l, h) per member and head: [members, heads].
    head_weights: torch.Tensor
    # Bytes of one row as pieces.
    row_bytes: int
    to_pieces: Callable[[torch.Tensor], torch.Tensor] | None = None
    # On a CPU: numpy views of ``rows`` (if int64 pieces already) and of
    # ``piece_weights``, for host passes.
    host_rows: np.ndarray | None = field(init=False, default=None)
    host_piece_weights: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.rows.device.type == "cpu":
            self.host_piece_weights = self.piece_weights.numpy()
            if self.to_pieces is None:
                self.host_rows = self.rows.numpy()

    @property
    def cell_pieces(self) -> int:
        """Pieces of a cell (over its parts)."""
        parts, _, _, pieces = self.dims
        return self.rows.shape[parts] * self.rows.shape[pieces]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The int64 pieces of ``rows``, a new contiguous tensor."""
        x = self.rows.index_select(0, rows)
        return x if self.to_pieces is None else self.to_pieces(x)

    def host_gather(self, rows: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """:meth:`gather` of a CPU source as a numpy array, into the start of
        ``scratch`` (int64, flat) where it fits."""
        if self.host_rows is None:
            return self.gather(torch.from_numpy(rows)).numpy()
        shape = (len(rows), *self.host_rows.shape[1:])
        numel = math.prod(shape)
        # np.take copies a source that is not C-contiguous whole first.
        if numel > scratch.size or not self.host_rows.flags.c_contiguous:
            gathered: np.ndarray = self.host_rows[rows]
            return gathered
        return np.take(self.host_rows, rows, axis=0, out=scratch[:numel].reshape(shape))


def _row_view(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int], int]:
    """One tensor whose rows are the blocks of all ``views`` (same dtype,
    shape and strides, one storage): it, each view's block-0 row, and the
    rows between consecutive blocks."""
    first = views[0]
    offsets = [view.storage_offset() for view in views]
    base = min(offsets)
    block_stride = first.stride(0)
    step = math.gcd(block_stride, *(offset - base for offset in offsets)) or 1
    num_rows = (max(offsets) - base + (first.shape[0] - 1) * block_stride) // step + 1
    rows = first.as_strided(
        (num_rows, *first.shape[1:]), (step, *first.stride()[1:]), base
    )
    return rows, [(offset - base) // step for offset in offsets], block_stride // step


def _source_key(view: torch.Tensor, *extra: object) -> tuple[object, ...]:
    """What views must share to be rows of one source."""
    return (
        view.device,
        view.untyped_storage().data_ptr(),
        view.dtype,
        tuple(view.shape),
        view.stride(),
        *extra,
    )


def _to_int64(rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` (last dim contiguous) read as int64 in place, or None."""
    try:
        return rows.view(torch.int64)
    except RuntimeError:
        return None


def _memory_order(view: torch.Tensor) -> list[int]:
    """Dims 1.. of ``view`` from the largest stride to the smallest (size-1
    dims first): the order a gather copies them in."""
    return sorted(
        range(1, view.dim()),
        key=lambda dim: (view.shape[dim] > 1, -view.stride()[dim]),
    )


def _kv_sources(layers: Sequence[KVLayer], shape: _Shape) -> list[_Source]:
    """The sources of a group's attention layers (cells of whole pieces)."""
    size = layers[0].kv.element_size()
    straddles = layers[0].layout is KVLayout.SPLIT and shape.head_elems * size % 8 != 0
    parts = 2 if layers[0].layout is KVLayout.SPLIT and not straddles else 1
    pieces = shape.cell_bytes // 8 // parts
    q = np.array([piece_weight(p) for p in range(parts * pieces)], dtype=np.uint64)
    canonical_q = q.view(np.int64).reshape(parts, 1, 1, pieces)
    by_key: dict[tuple[object, ...], list[tuple[KVLayer, torch.Tensor]]] = {}
    for layer in layers:
        ints = layer.kv.view(_INT_DTYPES[size])
        # [blocks, parts, tokens, heads, elements].
        if layer.layout is KVLayout.SPLIT:
            canonical = ints.transpose(0, 1)
        elif layer.layout is KVLayout.PACKED_NHD:
            canonical = ints[:, None]
        else:
            canonical = ints.permute(0, 2, 1, 3)[:, None]
        direct = None if straddles else _to_int64(canonical)
        view = canonical if direct is None else direct
        by_key.setdefault(_source_key(view, direct is not None), []).append(
            (layer, view)
        )
    sources = []
    for key, members in by_key.items():
        views = [view for _, view in members]
        if key[-1]:  # int64 pieces in place
            order = _memory_order(views[0])
            views = [view.permute(0, *order) for view in views]
            dims = tuple(order.index(dim) + 1 for dim in (1, 2, 3, 4))
            weights = np.ascontiguousarray(
                canonical_q.transpose([dim - 1 for dim in order])
            )
            to_pieces = None
        else:
            dims = (1, 2, 3, 4)
            weights = canonical_q
            to_pieces = _straddling_pieces if straddles else _contiguous_pieces
        rows, first_rows, block_rows = _row_view(views)
        heads = np.array(
            [
                [
                    layer_head_weight(layer.index, layer.head_offset + h)
                    for h in range(shape.heads)
                ]
                for layer, _ in members
            ],
            dtype=np.uint64,
        )
        device = layers[0].kv.device
        sources.append(
            _Source(
                rows=rows,
                members=[
                    _Member((layer.replicas, layer.replica_index), first_row, i)
                    for i, ((layer, _), first_row) in enumerate(
                        zip(members, first_rows, strict=True)
                    )
                ],
                block_rows=block_rows,
                num_blocks=shape.num_blocks,
                dims=dims,  # type: ignore[arg-type]
                piece_weights=torch.from_numpy(weights).to(device),
                head_weights=torch.from_numpy(heads.view(np.int64)).to(device),
                row_bytes=shape.block_size * shape.heads * shape.cell_bytes,
                to_pieces=to_pieces,
            )
        )
    return sources


def _contiguous_pieces(x: torch.Tensor) -> torch.Tensor:
    """Gathered canonical elements as int64 pieces."""
    return x.view(torch.int64)


def _straddling_pieces(x: torch.Tensor) -> torch.Tensor:
    """Gathered SPLIT elements whose K is not whole pieces: each cell's K
    then V bytes as one part of pieces."""
    n, _, block_size, heads, elems = x.shape
    x = x.permute(0, 2, 3, 1, 4).contiguous()
    return x.view(n, block_size, heads, 2 * elems).view(torch.int64)[:, None]


def _state_pieces(
    shard: StateShard | None,
    local_shape: tuple[int, ...],
    element_size: int,
    shard_index: int,
) -> np.ndarray | None:
    """Per 8-byte piece of a state share (zero-padded at its end), its index
    in the unsharded state; None if a piece would straddle two ranks'
    shares."""
    local_bytes = math.prod(local_shape) * element_size
    num_pieces = cdiv(local_bytes, 8)
    if shard is None:
        return np.arange(num_pieces, dtype=np.int64) + shard_index * num_pieces
    shape = shard.shape
    runs = shard.runs or ((0, shape[shard.dim]),)
    inner = math.prod(shape[shard.dim + 1 :]) * element_size
    outer = math.prod(shape[: shard.dim])
    # Byte runs of the share in the unsharded state, in the share's order.
    starts = (
        np.arange(outer, dtype=np.int64)[:, None] * shape[shard.dim] * inner
        + np.array([start for start, _ in runs], dtype=np.int64)[None, :] * inner
    ).ravel()
    lengths = np.tile(np.array([n for _, n in runs], dtype=np.int64) * inner, outer)
    # Runs that continue each other are one.
    joined = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
    bounds = np.concatenate(([0], joined, [len(starts)]))
    starts = starts[bounds[:-1]]
    lengths = np.add.reduceat(lengths, bounds[:-1])
    total = math.prod(shape) * element_size
    whole = lengths % 8 == 0
    whole[-1] |= starts[-1] + lengths[-1] == total
    if (starts % 8).any() or not whole.all():
        return None
    counts = -(-lengths // 8)
    first = np.repeat(starts // 8 - np.cumsum(counts) + counts, counts)
    pieces = first + np.arange(counts.sum(), dtype=np.int64)
    assert len(pieces) == num_pieces
    return pieces


def _state_rows(state: torch.Tensor) -> torch.Tensor:
    """A state tensor as ``[blocks, 1, 1, 1, pieces]`` int64 in place, or
    ``[blocks, *state]`` elements to gather first."""
    ints = state.view(_INT_DTYPES[state.element_size()])
    if state.shape[0] and state[0].is_contiguous():
        pieces = _to_int64(ints.flatten(1))
        if pieces is not None:
            return pieces[:, None, None, None, :]
    return ints


def _padded_pieces(num_pieces: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gathered state elements to ``[rows, 1, 1, 1, num_pieces]`` int64,
    zero-padded to whole pieces."""

    def to_pieces(x: torch.Tensor) -> torch.Tensor:
        data = x.reshape(len(x), -1).view(torch.uint8)
        pad = num_pieces * 8 - data.shape[1]
        if pad:
            data = torch.nn.functional.pad(data, (0, pad))
        return data.view(torch.int64)[:, None, None, None, :]

    return to_pieces


def _state_sources(
    layers: Sequence[KVStateLayer], tp_rank: int
) -> list[_Source] | None:
    """The sources of a group's state layers; None if some state's pieces
    would straddle TP shares."""
    by_key: dict[tuple[object, ...], list[tuple[KVStateLayer, int, torch.Tensor]]] = {}
    pieces_of: dict[tuple[object, ...], np.ndarray] = {}
    for layer in layers:
        for s, tensor in enumerate(layer.states):
            state = tensor.state
            shard_index = tp_rank // layer.replicas
            pieces = _state_pieces(
                tensor.shard, tuple(state.shape[1:]), state.element_size(), shard_index
            )
            if pieces is None:
                logger.warning(
                    "KV checksum group %d: state %d of %s has pieces across TP "
                    "shares; the group is skipped.",
                    layer.group_id,
                    s,
                    layer.name,
                )
                return None
            rows = _state_rows(state)
            key = _source_key(rows, state.dtype, tensor.shard, shard_index)
            by_key.setdefault(key, []).append((layer, s, rows))
            pieces_of[key] = pieces
    sources = []
    for key, members in by_key.items():
        pieces = pieces_of[key]
        views = [rows for _, _, rows in members]
        rows, first_rows, block_rows = _row_view(views)
        q = np.array([piece_weight(int(p)) for p in pieces], dtype=np.uint64)
        heads = np.array(
            [[layer_head_weight(layer.index, s)] for layer, s, _ in members],
            dtype=np.uint64,
        )
        device = rows.device
        direct = rows.dtype == torch.int64 and rows.dim() == 5
        sources.append(
            _Source(
                rows=rows,
                members=[
                    _Member((layer.replicas, layer.replica_index), first_row, i)
                    for i, ((layer, _, _), first_row) in enumerate(
                        zip(members, first_rows, strict=True)
                    )
                ],
                block_rows=block_rows,
                num_blocks=views[0].shape[0],
                dims=(1, 2, 3, 4),
                piece_weights=torch.from_numpy(
                    q.view(np.int64).reshape(1, 1, 1, -1)
                ).to(device),
                head_weights=torch.from_numpy(heads.view(np.int64)).to(device),
                row_bytes=8 * len(pieces),
                to_pieces=None if direct else _padded_pieces(len(pieces)),
            )
        )
    return sources


def _state_fingerprint(layer: KVStateLayer) -> int:
    """A state layer's share of its group's fingerprint: its name, spec type
    and each state's dtype and unsharded shape (the rank's shape where the
    shard is unknown)."""
    return hash64(
        "kvguard-state-v1",
        layer.name,
        layer.spec_type,
        *(
            (
                str(tensor.state.dtype).removeprefix("torch."),
                ("unsharded", tensor.shard.shape, tensor.shard.dim)
                if tensor.shard is not None
                else ("local", tuple(tensor.state.shape[1:])),
            )
            for tensor in layer.states
        ),
    )


@dataclass(frozen=True)
class _Work:
    """Members of one source that a pass reads together: one value column,
    at most a chunk's worth of rows per block."""

    source: _Source
    # Their block-0 rows and S(l, h): [members], [members, heads].
    first_rows: np.ndarray
    head_weights: torch.Tensor
    column: int
    # ``head_weights`` in host memory, on a CPU.
    host_head_weights: np.ndarray | None = None


@dataclass
class _GroupPlan:
    """The layers of one KV cache group this worker checksums."""

    group_id: int
    # Tokens per block: 1 for state groups (one state per block).
    block_size: int
    sources: list[_Source]
    # Checksum values per block: one per span of ``block_size // spans``
    # tokens (``kv_cache.checksum_tokens``).
    spans: int = 1
    # Bytes of rows a chunk may hold (the eager budget, the smaller): one
    # block's rows of a member set fit.
    chunk_bytes: int = 1 << 30
    _work: dict[bool, list[_Work]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return min(source.num_blocks for source in self.sources)

    def keys(self, sends_only: bool) -> list[ReplicaKey]:
        """The replica keys of its values, in column order."""
        return sorted(
            {
                member.key
                for source in self.sources
                for member in source.members
                if not sends_only or member.key[1] == 0
            }
        )

    def work(self, sends_only: bool) -> list[_Work]:
        """What a pass reads (sends: replica 0 only), member sets by source
        and column."""
        cached = self._work.get(sends_only)
        if cached is None:
            keys = self.keys(sends_only)
            cached = []
            for source in self.sources:
                by_key: dict[ReplicaKey, list[_Member]] = {}
                for m in source.members:
                    if not sends_only or m.key[1] == 0:
                        by_key.setdefault(m.key, []).append(m)
                step = max(1, self.chunk_bytes // source.row_bytes)
                for key, members in by_key.items():
                    for first in range(0, len(members), step):
                        chunk = members[first : first + step]
                        head_weights = source.head_weights[
                            [m.weight_row for m in chunk]
                        ]
                        cached.append(
                            _Work(
                                source,
                                np.array([m.first_row for m in chunk], np.int64),
                                head_weights,
                                keys.index(key),
                                head_weights.numpy()
                                if head_weights.device.type == "cpu"
                                else None,
                            )
                        )
            self._work[sends_only] = cached
        return cached


def _dedupe(layers: Sequence[KVLayer]) -> list[KVLayer]:
    """One layer per distinct KV tensor (the lowest index), by index."""
    unique: dict[tuple[object, ...], KVLayer] = {}
    for layer in sorted(layers, key=lambda layer: layer.index):
        kv = layer.kv
        key = (
            kv.device,
            kv.untyped_storage().data_ptr(),
            kv.storage_offset(),
            tuple(kv.shape),
            kv.stride(),
            kv.dtype,
            layer.layout,
        )
        unique.setdefault(key, layer)
    return list(unique.values())


def _check_layer(layer: AnyLayer) -> None:
    """Raises: ValueError: If the layer's coordinates are invalid."""
    if layer.index < 0 or (isinstance(layer, KVLayer) and layer.head_offset < 0):
        raise ValueError(f"layer {layer.name}: negative index or head offset")
    if layer.replicas < 1 or not 0 <= layer.replica_index < layer.replicas:
        raise ValueError(
            f"layer {layer.name}: replica {layer.replica_index} of {layer.replicas}"
        )
    if isinstance(layer, KVStateLayer):
        if not layer.states:
            raise ValueError(f"state layer {layer.name}: no states")
        for s, tensor in enumerate(layer.states):
            state, shard = tensor.state, tensor.shard
            if state.dim() < 2 or state.element_size() not in _INT_DTYPES:
                raise ValueError(
                    f"state layer {layer.name}: state {s} is not [blocks, ...] "
                    f"of a 1/2/4/8-byte dtype: {list(state.shape)} {state.dtype}"
                )
            if shard is not None and (
                not 0 <= shard.dim < len(shard.shape)
                or any(
                    start < 0 or length < 1 or start + length > shard.shape[shard.dim]
                    for start, length in shard.runs
                )
                or shard.local_shape() != tuple(state.shape[1:])
            ):
                raise ValueError(
                    f"state layer {layer.name}: state {s} of shape "
                    f"{list(state.shape[1:])} is not a share of {shard}"
                )


def _host_array(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """A pass's values in host memory (waits for the device)."""
    return values if isinstance(values, np.ndarray) else values.cpu().numpy()


def _devices(layers: Sequence[AnyLayer]) -> set[torch.device]:
    return {
        tensor.device
        for layer in layers
        for tensor in (
            [layer.kv]
            if isinstance(layer, KVLayer)
            else [state.state for state in layer.states]
        )
    }


@dataclass(frozen=True)
class _Slot:
    """Where one request's values of one group are in a pass's output."""

    # First span (block position times spans per block).
    start: int
    keys: list[ReplicaKey]
    offset: int
    num_values: int
    spans: int


# Per group of a pass: its plan, position weights [blocks, block_size] and,
# per member set, the rows it reads (block-major) and the values it adds to.
_PassWork = list[
    tuple[_GroupPlan, np.ndarray, list[tuple[_Work, np.ndarray, np.ndarray]]]
]


@dataclass
class _Computed:
    """One request's checksums of one pass, still on the device."""

    req_id: str
    # A load of offloaded KV: reported with the values stored with it.
    offloaded: bool
    groups: dict[int, _Slot]


@dataclass
class _Batch:
    """The checksums of one pass, being copied to the host as one array."""

    computed: list[_Computed]
    # The values: in host memory, or a pinned buffer being filled (CUDA).
    host: torch.Tensor | np.ndarray
    # CUDA: recorded on the copy stream once ``host`` is filled.
    event: torch.cuda.Event | None = None
    # Keeps the device copy's source alive until the event.
    device_values: torch.Tensor | None = None


@dataclass
class _Pending:
    """Requests scheduled for a checksum that is not taken yet."""

    sends: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    # Per request: its blocks, and whether they are offloaded KV.
    loads: dict[str, tuple[KVChecksumBlocks, bool]] = field(default_factory=dict)
    stored: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    received: dict[str, bytes] = field(default_factory=dict)


@dataclass
class _GroupRows:
    """A pass's live blocks of one group, over all its requests."""

    ids: list[int] = field(default_factory=list)
    # Per request: (first block position, live blocks, token count, offset
    # of its first value).
    requests: list[tuple[int, int, int, int]] = field(default_factory=list)

    def blocks(
        self, block_size: int, values_per_block: int
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]], np.ndarray]:
        """Per live block: its id, first token and the offset of its first
        value; and the blocks its request ends in (only a request's last live
        block can), as (index, tokens of the block before the end)."""
        # Built as lists: a pass is a few requests, and each numpy call costs
        # more than these (all the more in an engine, where it runs cold).
        first_tokens: list[int] = []
        ends: list[tuple[int, int]] = []
        offsets: list[int] = []
        for start, count, num_tokens, offset in self.requests:
            first = start * block_size
            first_tokens += range(first, first + count * block_size, block_size)
            offsets += range(
                offset, offset + count * values_per_block, values_per_block
            )
            kept = num_tokens - first_tokens[-1]
            if kept < block_size:
                ends.append((len(first_tokens) - 1, kept))
        return (
            np.array(self.ids, np.int64),
            np.array(first_tokens, np.int64),
            ends,
            np.array(offsets, np.int64),
        )


class _Metadata:
    """The int64 arrays a pass sends to the device, as one copy."""

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self._size = 0

    def add(self, array: np.ndarray) -> slice:
        """Queue ``array`` (flattened); its slice of :meth:`to_device`."""
        self._arrays.append(array.astype(np.int64, copy=False).ravel())
        start, self._size = self._size, self._size + array.size
        return slice(start, self._size)

    def to_device(self, device: torch.device) -> torch.Tensor:
        """Everything queued on ``device``, without waiting for the copy."""
        flat = torch.from_numpy(
            np.concatenate(self._arrays) if self._arrays else np.zeros(0, np.int64)
        )
        if device.type == "cpu":
            return flat
        if device.type == "cuda":
            flat = flat.pin_memory()
        return flat.to(device, non_blocking=True)


class KVChecksumWorker:
    """Checksums the blocks the scheduler asks for, on one worker.

    ``layers`` are attention layers (:class:`KVLayer`) and state layers
    (:class:`KVStateLayer`); one group holds one kind. ``compile`` fuses the
    checksum into one pass over the KV with ``torch.compile`` (compiled on
    first use, or by :meth:`warm_up`; same values; its speed against eager is
    what ``benchmarks/bench_checksum.py`` measures); None asks
    ``checksum_kernel.compile_default`` (on for accelerators, off for
    CPUs, unless ``KVGUARD_CHECKSUM_COMPILE`` says). On a CPU an eager
    pass runs in numpy (``host_pass``, the default; False keeps it in
    torch's ops, as on accelerators): in an engine each call of a pass runs
    with cold caches, where a call into torch costs several times one into
    numpy.
    ``max_scratch_bytes`` bounds the memory one chunk of a pass uses (never
    less than one block of one layer).

    A sliding-window group with blocks over 16 tokens is checksummed per
    16-token span (``kv_cache.checksum_tokens``): its ``values`` have
    ``block_size // 16`` rows per block, and its ``start`` counts spans. A
    state group has one value per block (the scheduler asks for the running
    state's block at position 0).

    Raises:
        ValueError: If a layer's tensor does not fit its layout, layers are
            on different devices, or a group mixes block sizes, spec types or
            attention and state layers.
    """

    def __init__(
        self,
        layers: Sequence[AnyLayer],
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        max_scratch_bytes: int = 64 << 20,
        compile: bool | None = None,
        host_pass: bool = True,
    ) -> None:
        if max_scratch_bytes < 1:
            raise ValueError(f"max_scratch_bytes must be positive: {max_scratch_bytes}")
        devices = _devices(layers)
        if len(devices) > 1:
            raise ValueError(
                f"KV layers on several devices: {sorted(map(str, devices))}"
            )
        self._device = devices.pop() if devices else torch.device("cpu")
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._max_scratch = max_scratch_bytes
        self._compile = (
            checksum_kernel.compile_default(self._device)
            if compile is None
            else compile
        )
        self._host_pass = host_pass and self._device.type == "cpu"
        self._groups: dict[int, _GroupPlan] = {}
        self._fingerprints: dict[int, int] = {}
        skipped: set[int] = set()
        by_group: dict[int, list[KVLayer]] = {}
        state_groups: dict[int, list[KVStateLayer]] = {}
        for layer in layers:
            _check_layer(layer)
            if isinstance(layer, KVStateLayer):
                state_groups.setdefault(layer.group_id, []).append(layer)
            else:
                by_group.setdefault(layer.group_id, []).append(layer)
        if mixed := sorted(by_group.keys() & state_groups.keys()):
            raise ValueError(f"groups {mixed} mix attention and state layers")
        for group_id, group_layers in by_group.items():
            unique = _dedupe(group_layers)
            indices = [layer.index for layer in unique]
            if len(set(indices)) != len(indices):
                # Still a checksum both sides agree on; only a swap of KV
                # between two such layers would go unnoticed.
                logger.warning(
                    "KV checksum group %d: distinct KV tensors share a layer "
                    "index (%s); swaps between them are not detected.",
                    group_id,
                    sorted({i for i in indices if indices.count(i) > 1}),
                )
            shapes = [_shape(layer.kv, layer.layout) for layer in unique]
            if len({shape.block_size for shape in shapes}) > 1:
                raise ValueError(f"group {group_id}: layers of different block sizes")
            spec_types = {layer.spec_type for layer in unique}
            if len(spec_types) > 1:
                raise ValueError(
                    f"group {group_id}: layers of spec types {sorted(spec_types)}"
                )
            self._fingerprints[group_id] = sum(
                layer_fingerprint(
                    layer.name,
                    layer.spec_type,
                    str(layer.kv.dtype).removeprefix("torch."),
                    shape.cell_bytes,
                    total_num_kv_heads=layer.total_num_kv_heads,
                )
                for layer, shape in zip(unique, shapes, strict=True)
            ) % (1 << 64)
            if any(
                shape.cell_bytes % 8 or layer.kv.element_size() not in _INT_DTYPES
                for layer, shape in zip(unique, shapes, strict=True)
            ):
                skipped.add(group_id)
                continue
            block_size = shapes[0].block_size
            sources: list[_Source] = []
            by_shape: dict[_Shape, list[KVLayer]] = {}
            for layer, shape in zip(unique, shapes, strict=True):
                by_shape.setdefault(shape, []).append(layer)
            for shape, shape_layers in by_shape.items():
                sources.extend(_kv_sources(shape_layers, shape))
            self._groups[group_id] = _GroupPlan(
                group_id,
                block_size,
                sources,
                block_size // checksum_tokens(spec_types.pop(), block_size),
                self._chunk_budget(compiled=False),
            )
        for group_id, state_layers in state_groups.items():
            self._plan_state_group(group_id, state_layers, skipped)
        self._skipped = frozenset(skipped)
        self._pending = _Pending()
        self._batches: list[_Batch] = []
        # A(t) for t < len, on the host; grown on demand.
        self._position_table = np.zeros(0, dtype=np.int64)
        # Per block size: the table's rows of that many consecutive tokens.
        self._position_windows: dict[int, np.ndarray] = {}
        self._scratch: torch.Tensor | None = None
        self._host_scratch = np.empty(0, np.int64)
        self._copy_stream: torch.cuda.Stream | None = None

    def _plan_state_group(
        self, group_id: int, layers: list[KVStateLayer], skipped: set[int]
    ) -> None:
        """Plan a group of state layers (or skip it)."""
        unique: dict[tuple[object, ...], KVStateLayer] = {}
        for layer in sorted(layers, key=lambda layer: layer.index):
            key = tuple(
                (
                    t.state.untyped_storage().data_ptr(),
                    t.state.storage_offset(),
                    tuple(t.state.shape),
                    t.state.stride(),
                    t.state.dtype,
                )
                for t in layer.states
            )
            unique.setdefault(key, layer)
        if len({layer.spec_type for layer in unique.values()}) > 1:
            raise ValueError(f"group {group_id}: state layers of several spec types")
        self._fingerprints[group_id] = sum(
            _state_fingerprint(layer) for layer in unique.values()
        ) % (1 << 64)
        sources = _state_sources(list(unique.values()), self._tp_rank)
        if sources is None:
            skipped.add(group_id)
            return
        self._groups[group_id] = _GroupPlan(
            group_id, 1, sources, chunk_bytes=self._chunk_budget(compiled=False)
        )

    @property
    def skipped_groups(self) -> frozenset[int]:
        """Groups this worker cannot checksum."""
        return self._skipped

    @property
    def fingerprints(self) -> dict[int, int]:
        """Per group, the sum of its layers' fingerprints on this worker."""
        return dict(self._fingerprints)

    @property
    def compiled(self) -> bool:
        """Whether passes run the fused (compiled) kernel."""
        if self._host_pass:
            return self._compile and checksum_kernel.can_compile()
        return self._compile and checksum_kernel.compiled_row_sums() is not None

    def warm_up(self) -> None:
        """Run passes over blocks 0 and 1 of every group, so that a compiled
        kernel compiles now (at startup) rather than in the first step that
        needs it. Call it in the grad mode the host's steps run in (vLLM's:
        ``torch.inference_mode``): the compiled code is for that mode only.
        Waits for the device."""
        block_size = max((plan.block_size for plan in self._groups.values()), default=1)
        # Two blocks, then one: torch.compile specializes a dim of size 1,
        # so a pass of one block has code of its own.
        for num_blocks in (2, 1):
            blocks = KVChecksumBlocks(
                num_blocks * block_size,
                {
                    group_id: (0, [0, 1][: min(num_blocks, plan.num_blocks)])
                    for group_id, plan in self._groups.items()
                },
            )
            if blocks.groups:
                _host_array(
                    self._run([("warm-up", blocks, False)], sends_only=False)[1]
                )

    def begin_step(self, scheduled: KVChecksumScheduled | None) -> None:
        """Take the step's scheduled requests."""
        pending = self._pending
        pending.sends = dict(scheduled.reqs_to_send) if scheduled else {}
        if scheduled is None:
            return
        for req_id, blocks in scheduled.reqs_to_recv.items():
            pending.loads[req_id] = (blocks, False)
        for req_id, blocks in scheduled.reqs_to_load.items():
            pending.loads[req_id] = (blocks, True)

    def after_forward(self) -> None:
        """Checksum the sends scheduled this step (their KV is now final), in
        one pass.

        A send reports only replica 0 of replicated heads, so that the sum
        over all workers counts each head once (the producer's payload).
        """
        sends, self._pending.sends = self._pending.sends, {}
        if sends:
            self._flush(
                *self._run(
                    [(req_id, blocks, False) for req_id, blocks in sends.items()],
                    sends_only=True,
                )
            )

    def on_loads_finished(self, req_ids: Iterable[str]) -> None:
        """Checksum the blocks of these finished recvs and loads, in one
        pass."""
        requests = []
        for req_id in req_ids:
            load = self._pending.loads.pop(req_id, None)
            if load is not None:
                blocks, offloaded = load
                requests.append((req_id, blocks, offloaded))
        if requests:
            self._flush(*self._run(requests, sends_only=False))

    def add_received(self, req_id: str, data: bytes) -> None:
        """A producer payload the connector received with a load."""
        self._pending.received[req_id] = bytes(data)

    def set_stored(self, req_id: str, stored: Mapping[int, np.ndarray]) -> None:
        """The per-block values offloaded with the KV a load brings back.

        Per group, one value per block of the request's ``reqs_to_load``
        entry, as ``init_block_checksums`` returned them; call before the
        ``take_record`` of the step whose ``on_loads_finished`` has the load.
        A load reported without them (or with the wrong number) is left out
        of the record, so the scheduler finds it unverified.
        """
        self._pending.stored[req_id] = {
            group_id: np.array(values, dtype=np.uint64)
            for group_id, values in stored.items()
        }

    def request_finished(self, req_ids: Iterable[str]) -> None:
        """Drop state of requests that finished (or were aborted)."""
        pending = self._pending
        for req_id in req_ids:
            pending.sends.pop(req_id, None)
            pending.loads.pop(req_id, None)
            pending.stored.pop(req_id, None)
            pending.received.pop(req_id, None)

    def held_request_ids(self) -> set[str]:
        """The requests the worker holds anything of: scheduled and not
        reported yet, or not finished (:meth:`request_finished`)."""
        pending = self._pending
        return {*pending.sends, *pending.loads, *pending.stored, *pending.received}

    def take_record(self) -> KVChecksumRecord | None:
        """This step's report, or None if it has nothing to report; waits for
        values still being copied from the device."""
        checksums: dict[str, dict[int, KVChecksumGroup]] = {}
        for batch in self._batches:
            if batch.event is not None:
                batch.event.synchronize()
            flat = _host_array(batch.host).view(np.uint64)
            for computed in batch.computed:
                groups = {
                    group_id: KVChecksumGroup(
                        slot.start,
                        slot.keys,
                        # A copy: pinned host memory goes back to its cache.
                        flat[
                            slot.offset : slot.offset + slot.num_values * len(slot.keys)
                        ]
                        .reshape(slot.num_values, len(slot.keys))
                        .copy(),
                    )
                    for group_id, slot in computed.groups.items()
                }
                if computed.offloaded and not self._attach_stored(
                    computed.req_id, groups, computed.groups
                ):
                    continue
                checksums[computed.req_id] = groups
        self._batches.clear()
        received, self._pending.received = self._pending.received, {}
        if not checksums and not received:
            return None
        return KVChecksumRecord(
            pp_rank=self._pp_rank,
            tp_rank=self._tp_rank,
            checksums=checksums,
            skipped_groups=self._skipped,
            fingerprints=dict(self._fingerprints),
            received=received,
        )

    def init_block_checksums(
        self, blocks: KVChecksumBlocks, block_hashes: Mapping[int, Sequence[bytes]]
    ) -> dict[int, np.ndarray]:
        """Per group, the value to offload with each block: the sum of its
        replica columns (and spans) XOR ``block_checksum_tags`` of its block
        hash.

        ``block_hashes`` has, per group, the hash of each block of
        ``blocks``. Groups this worker does not checksum are left out. Waits
        for the device.

        Raises:
            ValueError: If a group's hashes are missing or not one per block.
        """
        groups = {g: blocks.groups[g] for g in blocks.groups if g in self._groups}
        for group_id, (_, block_ids) in groups.items():
            hashes = block_hashes.get(group_id)
            if hashes is None or len(hashes) != len(block_ids):
                raise ValueError(
                    f"group {group_id}: {len(block_ids)} blocks but "
                    f"{'no' if hashes is None else len(hashes)} block hashes"
                )
        (computed,), values = self._run(
            [("offload", KVChecksumBlocks(blocks.num_tokens, groups), False)],
            sends_only=False,
        )
        flat = _host_array(values).view(np.uint64)
        out: dict[int, np.ndarray] = {}
        for group_id, slot in computed.groups.items():
            num_blocks = len(groups[group_id][1])
            sums = (
                flat[slot.offset : slot.offset + slot.num_values * len(slot.keys)]
                .reshape(num_blocks, -1)
                .sum(axis=1, dtype=np.uint64)
            )
            out[group_id] = sums ^ block_checksum_tags(
                block_hashes[group_id], self._fingerprints[group_id]
            )
        return out

    def _attach_stored(
        self,
        req_id: str,
        groups: dict[int, KVChecksumGroup],
        slots: Mapping[int, _Slot],
    ) -> bool:
        """Give a load of offloaded KV its stored values (one per block);
        False if some are missing."""
        stored = self._pending.stored.pop(req_id, {})
        for group_id, group in groups.items():
            values = stored.get(group_id)
            num_blocks = len(group.values) // slots[group_id].spans
            if values is None or values.shape != (num_blocks,):
                logger.warning(
                    "No stored KV checksums of group %d for request %s: "
                    "its load is reported unverified.",
                    group_id,
                    req_id,
                )
                return False
            group.stored = values
        return True

    # --- One pass --------------------------------------------------------

    def _run(
        self,
        requests: Sequence[tuple[str, KVChecksumBlocks, bool]],
        *,
        sends_only: bool,
    ) -> tuple[list[_Computed], torch.Tensor | np.ndarray]:
        """Checksum ``(req_id, blocks, offloaded)`` requests in one pass: their
        slots and the values of all (int64): in host memory for a host pass,
        else on the device (not yet computed where it is asynchronous).

        Raises:
            ValueError: If a block id is not in the KV tensors (before any
                work is queued).
        """
        keys_of = {
            group_id: plan.keys(sends_only) for group_id, plan in self._groups.items()
        }
        computed, rows_of, size = self._slots(requests, keys_of)
        work = self._pass_work(rows_of, keys_of, sends_only)
        if self._host_pass:
            return computed, self._host_sums(work, size)
        return computed, self._device_sums(work, size)

    def _slots(
        self,
        requests: Sequence[tuple[str, KVChecksumBlocks, bool]],
        keys_of: dict[int, list[ReplicaKey]],
    ) -> tuple[list[_Computed], dict[int, _GroupRows], int]:
        """Each request's slots in a pass's values, the live blocks per
        group, and the values' size.

        Raises:
            ValueError: If a block id is not in the KV tensors.
        """
        computed: list[_Computed] = []
        rows_of: dict[int, _GroupRows] = {}
        size = 0
        for req_id, blocks, offloaded in requests:
            slots: dict[int, _Slot] = {}
            for group_id, (start, block_ids) in blocks.groups.items():
                plan = self._groups.get(group_id)
                if plan is None:
                    continue
                keys = keys_of[group_id]
                slot = _Slot(
                    start * plan.spans,
                    keys,
                    size,
                    len(block_ids) * plan.spans,
                    plan.spans,
                )
                slots[group_id] = slot
                size += slot.num_values * len(keys)
                # Blocks wholly past num_tokens hold nothing to sum.
                num_live = max(
                    0,
                    min(
                        len(block_ids), cdiv(blocks.num_tokens, plan.block_size) - start
                    ),
                )
                if not num_live or not keys:
                    continue
                group = rows_of.setdefault(group_id, _GroupRows())
                group.ids.extend(block_ids[:num_live])
                group.requests.append((start, num_live, blocks.num_tokens, slot.offset))
            computed.append(_Computed(req_id, offloaded, slots))
        for group_id, group in rows_of.items():
            num_blocks = self._groups[group_id].num_blocks
            if min(group.ids) < 0 or max(group.ids) >= num_blocks:
                raise ValueError(
                    f"group {group_id}: block ids outside [0, {num_blocks})"
                )
        return computed, rows_of, size

    def _pass_work(
        self,
        rows_of: dict[int, _GroupRows],
        keys_of: dict[int, list[ReplicaKey]],
        sends_only: bool,
    ) -> _PassWork:
        """Per group of a pass: its position weights ``[blocks, block_size]``
        and, per member set, the rows it reads (block-major) and the values
        its span sums go to."""
        work = []
        for group_id, group in rows_of.items():
            plan = self._groups[group_id]
            num_keys = len(keys_of[group_id])
            ids, first_tokens, ends, offsets = group.blocks(
                plan.block_size, plan.spans * num_keys
            )
            positions = self._positions(first_tokens, ends, plan.block_size)
            span_offsets = np.arange(plan.spans) * num_keys
            items = [
                (
                    item,
                    (ids[:, None] * item.source.block_rows + item.first_rows).ravel(),
                    ((offsets + item.column)[:, None] + span_offsets).ravel(),
                )
                for item in plan.work(sends_only)
            ]
            work.append((plan, positions, items))
        return work

    @torch.no_grad()
    def _device_sums(
        self,
        work: _PassWork,
        size: int,
    ) -> torch.Tensor:
        """A pass's values on the device, its metadata sent in one copy."""
        values = torch.zeros(size, dtype=torch.int64, device=self._device)
        metadata = _Metadata()
        # (plan, member set, metadata slices of positions, rows and outputs)
        slices: list[tuple[_GroupPlan, _Work, slice, slice, slice]] = []
        for plan, positions, items in work:
            position_slice = metadata.add(positions)
            for item, rows, out in items:
                slices.append(
                    (plan, item, position_slice, metadata.add(rows), metadata.add(out))
                )
        if slices:
            device_metadata = metadata.to_device(self._device)
            for plan, item, position_slice, row_slice, out_slice in slices:
                self._work_sums(
                    item,
                    plan.spans,
                    device_metadata[row_slice],
                    device_metadata[position_slice].view(-1, plan.block_size),
                    device_metadata[out_slice],
                    values,
                )
        return values

    def _host_sums(
        self,
        work: _PassWork,
        size: int,
    ) -> np.ndarray:
        """A pass's values computed in numpy (CPU, eager), a chunk of blocks
        at a time, as :meth:`_work_sums` does on a device."""
        values = np.zeros(size, np.int64)
        budget = self._chunk_budget(False)
        for plan, positions, items in work:
            spans = plan.spans
            for item, rows, out in items:
                source = item.source
                assert source.host_piece_weights is not None
                assert item.host_head_weights is not None
                members = len(item.first_rows)
                chunk = max(1, budget // (members * source.row_bytes))
                for first in range(0, len(positions), chunk):
                    end = min(len(positions), first + chunk)
                    numel = (end - first) * members * source.row_bytes // 8
                    # Reused, as on a device: fresh memory would fault in.
                    scratch = self._host_scratch_for(2 * numel)
                    x = source.host_gather(
                        rows[first * members : end * members], scratch[:numel]
                    )
                    sums = None
                    kernel = (
                        self._host_kernel(item, spans, x, positions)
                        if self._compile
                        else None
                    )
                    if kernel is not None:
                        try:
                            sums = kernel(
                                np.ascontiguousarray(x),
                                source.piece_weights,
                                item.head_weights,
                                positions[first:end],
                            )
                        except Exception as e:  # The runner raises many kinds.
                            # Eager from here on, for every pass.
                            checksum_kernel.compile_failed(e)
                    if sums is None:
                        sums = checksum_kernel.host_row_sums_(
                            x,
                            scratch[numel : numel + x.size].reshape(x.shape),
                            source.host_piece_weights,
                            item.host_head_weights,
                            positions[first:end],
                            spans,
                            source.dims,
                        )
                    # Each value of a pass is one block's span: no index twice.
                    values[out[first * spans : end * spans]] += sums.reshape(-1)
        return values

    @staticmethod
    def _host_kernel(
        item: _Work, spans: int, x: np.ndarray, positions: np.ndarray
    ) -> aot_kernel.HostKernel | None:
        """The fused kernel of a host pass over ``item``'s rows gathered as
        ``x`` (built or loaded on first use), None once compiling failed."""
        source = item.source
        assert source.host_piece_weights is not None
        assert item.host_head_weights is not None
        return aot_kernel.host_kernel(
            x.shape[1:],
            source.dims,
            spans,
            source.host_piece_weights,
            item.host_head_weights,
            positions.shape[1],
        )

    def _work_sums(
        self,
        item: _Work,
        spans: int,
        rows: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Add the span sums of ``item``'s members' blocks (``rows``,
        block-major) into ``values`` at ``out`` (``spans`` per block), a chunk
        of blocks at a time."""
        source = item.source
        kernel = checksum_kernel.compiled_row_sums() if self._compile else None
        members = len(item.first_rows)
        row_bytes = source.row_bytes
        if kernel is not None and source.to_pieces is None:
            # Fused over rows read in place: only per-cell sums are made.
            row_bytes //= source.cell_pieces
        chunk = max(1, self._chunk_budget(kernel is not None) // (members * row_bytes))
        for first in range(0, len(positions), chunk):
            end = min(len(positions), first + chunk)
            block_rows = rows[first * members : end * members]
            sums = None
            if kernel is not None:
                try:
                    if source.to_pieces is None:
                        src, index = source.rows, block_rows
                    else:
                        src = source.gather(block_rows)
                        index = torch.arange(len(src), device=src.device)
                    sums = kernel(
                        src,
                        index,
                        source.piece_weights,
                        item.head_weights,
                        positions[first:end],
                        spans,
                        source.dims,
                    )
                except Exception as e:  # Inductor raises errors of many kinds.
                    checksum_kernel.compile_failed(e)
                    kernel = None
            if sums is None:
                sums = self._eager_sums(
                    source, block_rows, item.head_weights, positions[first:end], spans
                )
            values.index_add_(0, out[first * spans : end * spans], sums.view(-1))

    def _eager_sums(
        self,
        source: _Source,
        rows: torch.Tensor,
        head_weights: torch.Tensor,
        positions: torch.Tensor,
        spans: int,
    ) -> torch.Tensor:
        """:func:`checksum_kernel.gathered_row_sums_` of ``rows``, gathered
        into reused scratch where it can be."""
        shape = (len(rows), *source.rows.shape[1:])
        numel = math.prod(shape)
        scratch = self._scratch_for(2 * max(numel, len(rows) * source.row_bytes // 8))
        if source.to_pieces is None and scratch is not None:
            x = torch.index_select(
                source.rows, 0, rows, out=scratch[:numel].view(shape)
            )
        else:
            x = source.gather(rows)
        if scratch is not None:
            tmp = scratch[x.numel() : 2 * x.numel()].view(x.shape)
        else:
            tmp = torch.empty_like(x)
        return checksum_kernel.gathered_row_sums_(
            x, tmp, source.piece_weights, head_weights, positions, spans, source.dims
        )

    def _chunk_budget(self, compiled: bool) -> int:
        """Bytes of rows one kernel call reads, to bound its memory."""
        if compiled:
            # Fused: only a gather (if not in place) is materialised.
            return self._max_scratch
        # Eager: the gathered pieces and as much scratch.
        budget = self._max_scratch // 2
        if self._device.type == "cpu":
            budget = min(budget, _EAGER_CPU_CHUNK_BYTES)
        return budget

    def _host_scratch_for(self, numel: int) -> np.ndarray:
        """Reused int64 scratch of a host pass."""
        if self._host_scratch.size < numel:
            self._host_scratch = np.empty(numel, np.int64)
        return self._host_scratch

    def _scratch_for(self, numel: int) -> torch.Tensor | None:
        """Reused eager scratch on a CPU (none on accelerators, whose
        caching allocators reuse memory already)."""
        if self._device.type != "cpu":
            return None
        if (
            self._scratch is None
            or self._scratch.numel() < numel
            # Made under torch.inference_mode, it cannot be written outside.
            or (self._scratch.is_inference() and not torch.is_inference_mode_enabled())
        ):
            self._scratch = torch.empty(numel, dtype=torch.int64)
        return self._scratch

    def _positions(
        self, first_tokens: np.ndarray, ends: list[tuple[int, int]], block_size: int
    ) -> np.ndarray:
        """``A(t)`` of the tokens of blocks starting at ``first_tokens``, 0 from
        each of ``ends`` (block index, tokens kept) on: ``[blocks,
        block_size]``."""
        if not len(first_tokens):
            return np.zeros((0, block_size), np.int64)
        end = int(first_tokens.max()) + block_size
        if len(self._position_table) < end:
            size = max(end, 2 * len(self._position_table), 1 << 12)
            self._position_table = position_weights(0, size).view(np.int64)
            self._position_windows = {}
        windows = self._position_windows.get(block_size)
        if windows is None:
            windows = np.lib.stride_tricks.sliding_window_view(
                self._position_table, block_size
            )
            self._position_windows[block_size] = windows
        weights: np.ndarray = windows[first_tokens]
        for index, kept in ends:
            weights[index, kept:] = 0
        return weights

    def _flush(
        self, computed: list[_Computed], values: torch.Tensor | np.ndarray
    ) -> None:
        """Start copying a pass's checksums to the host (a host pass's are
        there)."""
        if isinstance(values, np.ndarray):
            self._batches.append(_Batch(computed, values))
            return
        if self._device.type != "cuda":
            self._batches.append(_Batch(computed, values.cpu()))
            return
        host = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
        # torch.cuda's Stream and Event constructors carry no annotations.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        self._batches.append(_Batch(computed, host, event, values))
