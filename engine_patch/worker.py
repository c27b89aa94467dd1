"""Worker-side KV checksums (torch): the partial checksums of ``checksum.md``
over the KV tensors one TP rank of one PP stage holds.

The host engine's worker (vLLM's worker-side connector, the fake engine's
simulated TP workers) drives it once per step::

    worker = KVChecksumWorker(layers, tp_rank=r, pp_rank=s)
    worker.begin_step(scheduled)   # the scheduler's KVChecksumScheduled, or None
    ...forward pass writes KV...
    worker.after_forward()         # checksums this step's sends
    worker.on_loads_finished(ids)  # checksums finished recvs/loads, before
                                   # any later step can write their blocks
    record = worker.take_record()  # KVChecksumRecord for the scheduler, or None

On CUDA nothing in a step waits for the device: the checksums are computed
on the current stream, copied to pinned host memory on a side stream, and
``take_record`` waits for that copy.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_patch import checksum_kernel
from engine_patch.hashing import (
    block_checksum_tags,
    layer_fingerprint,
    layer_head_weight,
    piece_weight,
    position_weights,
)
from engine_patch.kv_cache import cdiv, checksum_tokens
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
    ReplicaKey,
)

logger = logging.getLogger(__name__)

# Eager kernels on a CPU gather this many bytes per layer and pass, so that
# their dozen passes over it stay in the core's cache.
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


@dataclass
class _LayerPlan:
    """How one layer's blocks are read and weighted."""

    layer: KVLayer
    num_blocks: int
    # KV in the canonical [blocks, parts, tokens, heads, elems] order: int64
    # pieces if ``direct``, else integers of the KV's element size, gathered
    # and made contiguous before they are read as pieces.
    src: torch.Tensor
    direct: bool
    # SPLIT KV whose K is not whole pieces: a cell's pieces straddle K and V.
    straddles: bool
    # S(l, h) · Q(p), [parts, 1, heads, pieces].
    weights: torch.Tensor
    block_bytes: int

    @property
    def key(self) -> ReplicaKey:
        return (self.layer.replicas, self.layer.replica_index)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The canonical int64 pieces of blocks ``ids``, a new tensor."""
        x = self.src.index_select(0, ids)
        if self.straddles:
            n, _, block_size, heads, elems = x.shape
            x = x.permute(0, 2, 3, 1, 4).contiguous()
            return x.view(n, block_size, heads, 2 * elems).view(torch.int64)[:, None]
        return x.contiguous().view(torch.int64)


def _plan_layer(layer: KVLayer, shape: _Shape) -> _LayerPlan:
    """A layer's plan; its cells must be whole 8-byte pieces."""
    kv = layer.kv
    ints = kv.view(_INT_DTYPES[kv.element_size()])
    if layer.layout is KVLayout.SPLIT:
        canonical = ints.transpose(0, 1)
        straddles = shape.head_elems * kv.element_size() % 8 != 0
    elif layer.layout is KVLayout.PACKED_NHD:
        canonical = ints[:, None]
        straddles = False
    else:
        canonical = ints.permute(0, 2, 1, 3)[:, None]
        straddles = False
    direct = False
    if not straddles:
        try:
            canonical = canonical.view(torch.int64)
            direct = True
        except RuntimeError:
            # Not viewable in place (e.g. strided last dim): gathered first.
            pass
    parts = 2 if layer.layout is KVLayout.SPLIT and not straddles else 1
    pieces = shape.cell_bytes // 8 // parts
    heads = np.array(
        [
            layer_head_weight(layer.index, layer.head_offset + h)
            for h in range(shape.heads)
        ],
        dtype=np.uint64,
    )
    pieces_q = np.array(
        [piece_weight(p) for p in range(parts * pieces)], dtype=np.uint64
    ).reshape(parts, 1, 1, pieces)
    # uint64 products wrap modulo 2^64, as the definition's do.
    weights = (pieces_q * heads[None, None, :, None]).view(np.int64)
    return _LayerPlan(
        layer=layer,
        num_blocks=shape.num_blocks,
        src=canonical,
        direct=direct,
        straddles=straddles,
        weights=torch.from_numpy(weights).to(kv.device),
        block_bytes=shape.block_size * shape.heads * shape.cell_bytes,
    )


@dataclass
class _GroupPlan:
    """The layers of one KV cache group this worker checksums."""

    group_id: int
    block_size: int
    layers: list[_LayerPlan]
    # Checksum values per block: one per span of ``block_size // spans``
    # tokens (``kv_cache.checksum_tokens``).
    spans: int = 1

    @property
    def num_blocks(self) -> int:
        return min(plan.num_blocks for plan in self.layers)


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


def _check_layer(layer: KVLayer) -> None:
    """Raises: ValueError: If the layer's coordinates are invalid."""
    if layer.index < 0 or layer.head_offset < 0:
        raise ValueError(f"layer {layer.name}: negative index or head offset")
    if layer.replicas < 1 or not 0 <= layer.replica_index < layer.replicas:
        raise ValueError(
            f"layer {layer.name}: replica {layer.replica_index} of {layer.replicas}"
        )


@dataclass
class _Computed:
    """One request's checksums of one pass, still on the device."""

    req_id: str
    # A load of offloaded KV: reported with the values stored with it.
    offloaded: bool
    # Per group: first span, replica keys, values [spans, keys], spans per
    # block.
    groups: dict[int, tuple[int, list[ReplicaKey], torch.Tensor, int]]


@dataclass
class _Batch:
    """The checksums of one pass, being copied to the host as one array."""

    computed: list[_Computed]
    host: torch.Tensor
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


class KVChecksumWorker:
    """Checksums the blocks the scheduler asks for, on one worker.

    ``compile`` fuses the checksum into one pass over the KV with
    ``torch.compile`` (compiled on first use; about 3x to 30x faster than
    eager, same values); None reads ``KVGUARD_CHECKSUM_COMPILE``.
    ``max_scratch_bytes`` bounds the memory one pass over a layer uses
    (never less than one block).

    A sliding-window group with blocks over 16 tokens is checksummed per
    16-token span (``kv_cache.checksum_tokens``): its ``values`` have
    ``block_size // 16`` rows per block, and its ``start`` counts spans.

    Raises:
        ValueError: If a layer's tensor does not fit its layout, layers are
            on different devices, or a group mixes block sizes or spec types.
    """

    def __init__(
        self,
        layers: Sequence[KVLayer],
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        max_scratch_bytes: int = 64 << 20,
        compile: bool | None = None,
    ) -> None:
        if max_scratch_bytes < 1:
            raise ValueError(f"max_scratch_bytes must be positive: {max_scratch_bytes}")
        devices = {layer.kv.device for layer in layers}
        if len(devices) > 1:
            raise ValueError(
                f"KV layers on several devices: {sorted(map(str, devices))}"
            )
        self._device = devices.pop() if devices else torch.device("cpu")
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._max_scratch = max_scratch_bytes
        self._compile = (
            checksum_kernel.compile_default() if compile is None else compile
        )
        self._groups: dict[int, _GroupPlan] = {}
        self._fingerprints: dict[int, int] = {}
        skipped: set[int] = set()
        by_group: dict[int, list[KVLayer]] = {}
        for layer in layers:
            _check_layer(layer)
            by_group.setdefault(layer.group_id, []).append(layer)
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
            self._groups[group_id] = _GroupPlan(
                group_id,
                block_size,
                [
                    _plan_layer(layer, shape)
                    for layer, shape in zip(unique, shapes, strict=True)
                ],
                block_size // checksum_tokens(spec_types.pop(), block_size),
            )
        self._skipped = frozenset(skipped)
        self._pending = _Pending()
        self._batches: list[_Batch] = []
        # A(t) for t < len, on the device; grown on demand.
        self._position_table = torch.empty(0, dtype=torch.int64, device=self._device)
        self._scratch: torch.Tensor | None = None
        self._copy_stream: torch.cuda.Stream | None = None

    @property
    def skipped_groups(self) -> frozenset[int]:
        """Groups this worker cannot checksum."""
        return self._skipped

    @property
    def fingerprints(self) -> dict[int, int]:
        """Per group, the sum of its layers' fingerprints on this worker."""
        return dict(self._fingerprints)

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
        """Checksum the sends scheduled this step (their KV is now final).

        A send reports only replica 0 of replicated heads, so that the sum
        over all workers counts each head once (the producer's payload).
        """
        sends, self._pending.sends = self._pending.sends, {}
        self._flush(
            [
                self._compute(req_id, blocks, sends_only=True, offloaded=False)
                for req_id, blocks in sends.items()
            ]
        )

    def on_loads_finished(self, req_ids: Iterable[str]) -> None:
        """Checksum the blocks of these finished recvs and loads."""
        computed = []
        for req_id in req_ids:
            load = self._pending.loads.pop(req_id, None)
            if load is not None:
                blocks, offloaded = load
                computed.append(
                    self._compute(req_id, blocks, sends_only=False, offloaded=offloaded)
                )
        self._flush(computed)

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

    def take_record(self) -> KVChecksumRecord | None:
        """This step's report, or None if it has nothing to report; waits for
        values still being copied from the device."""
        checksums: dict[str, dict[int, KVChecksumGroup]] = {}
        for batch in self._batches:
            if batch.event is not None:
                batch.event.synchronize()
            flat = batch.host.numpy().view(np.uint64)
            offset = 0
            for computed in batch.computed:
                groups: dict[int, KVChecksumGroup] = {}
                spans: dict[int, int] = {}
                for group_id, (start, keys, values, k) in computed.groups.items():
                    size = values.numel()
                    groups[group_id] = KVChecksumGroup(
                        start,
                        keys,
                        # A copy: pinned host memory goes back to its cache.
                        flat[offset : offset + size]
                        .reshape(len(values), len(keys))
                        .copy(),
                    )
                    spans[group_id] = k
                    offset += size
                if computed.offloaded and not self._attach_stored(
                    computed.req_id, groups, spans
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
        out: dict[int, np.ndarray] = {}
        for group_id, (start, block_ids) in blocks.groups.items():
            plan = self._groups.get(group_id)
            if plan is None:
                continue
            hashes = block_hashes.get(group_id)
            if hashes is None or len(hashes) != len(block_ids):
                raise ValueError(
                    f"group {group_id}: {len(block_ids)} blocks but "
                    f"{'no' if hashes is None else len(hashes)} block hashes"
                )
            _, values = self._group_values(
                plan, start, block_ids, blocks.num_tokens, sends_only=False
            )
            sums = (
                values.view(len(block_ids), -1).sum(dim=1).cpu().numpy().view(np.uint64)
            )
            out[group_id] = sums ^ block_checksum_tags(
                hashes, self._fingerprints[group_id]
            )
        return out

    def _attach_stored(
        self,
        req_id: str,
        groups: dict[int, KVChecksumGroup],
        spans: Mapping[int, int],
    ) -> bool:
        """Give a load of offloaded KV its stored values (one per block of
        ``spans[group]`` values); False if some are missing."""
        stored = self._pending.stored.pop(req_id, {})
        for group_id, group in groups.items():
            values = stored.get(group_id)
            num_blocks = len(group.values) // spans[group_id]
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

    def _compute(
        self,
        req_id: str,
        blocks: KVChecksumBlocks,
        *,
        sends_only: bool,
        offloaded: bool,
    ) -> _Computed:
        """A request's checksums in every group this worker checksums."""
        groups: dict[int, tuple[int, list[ReplicaKey], torch.Tensor, int]] = {}
        for group_id, (start, block_ids) in blocks.groups.items():
            plan = self._groups.get(group_id)
            if plan is not None:
                keys, values = self._group_values(
                    plan, start, block_ids, blocks.num_tokens, sends_only=sends_only
                )
                groups[group_id] = (start * plan.spans, keys, values, plan.spans)
        return _Computed(req_id, offloaded, groups)

    @torch.no_grad()
    def _group_values(
        self,
        plan: _GroupPlan,
        start: int,
        block_ids: Sequence[int],
        num_tokens: int,
        *,
        sends_only: bool,
    ) -> tuple[list[ReplicaKey], torch.Tensor]:
        """The replica keys and, on the device, the values [spans, keys] of
        blocks ``block_ids`` at positions from ``start``.

        Raises:
            ValueError: If a block id is not in the KV tensors.
        """
        layers = [
            layer
            for layer in plan.layers
            if not sends_only or layer.layer.replica_index == 0
        ]
        keys = sorted({layer.key for layer in layers})
        spans = plan.spans
        values = torch.zeros(
            (len(block_ids) * spans, len(keys)), dtype=torch.int64, device=self._device
        )
        # Blocks wholly past num_tokens hold nothing to sum.
        num_live = max(
            0, min(len(block_ids), cdiv(num_tokens, plan.block_size) - start)
        )
        if not num_live or not layers:
            return keys, values
        live = block_ids[:num_live]
        if min(live) < 0 or max(live) >= plan.num_blocks:
            raise ValueError(
                f"group {plan.group_id}: block ids outside [0, {plan.num_blocks})"
            )
        ids = self._to_device(np.asarray(live, dtype=np.int64))
        positions = self._positions(start, num_live, plan.block_size, num_tokens).view(
            num_live, spans, -1
        )
        for layer in layers:
            column = keys.index(layer.key)
            chunk = self._chunk_blocks(layer)
            for first in range(0, num_live, chunk):
                end = min(num_live, first + chunk)
                values[first * spans : end * spans, column] += self._layer_sums(
                    layer, ids[first:end], positions[first:end]
                ).reshape(-1)
        return keys, values

    def _layer_sums(
        self, layer: _LayerPlan, ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One layer's checksums of blocks ``ids``, ``[blocks, spans]``: fused
        if compiled."""
        if self._compile and (kernel := checksum_kernel.compiled_block_sums()):
            try:
                if layer.direct:
                    return kernel(layer.src, ids, layer.weights, positions)
                index = torch.arange(len(ids), device=self._device)
                return kernel(layer.gather(ids), index, layer.weights, positions)
            except Exception as e:  # Inductor raises errors of many kinds.
                checksum_kernel.compile_failed(e)
        if layer.direct:
            return checksum_kernel.block_sums_eager(
                layer.src,
                ids,
                layer.weights,
                positions,
                self._scratch_for(2 * len(ids) * layer.block_bytes // 8),
            )
        return checksum_kernel.gathered_sums_(
            layer.gather(ids), layer.weights, positions
        )

    def _chunk_blocks(self, layer: _LayerPlan) -> int:
        """Blocks of ``layer`` one kernel call reads, to bound its memory."""
        if self._compile and checksum_kernel.compiled_block_sums():
            # Fused: only a gather (if not direct) is materialised.
            budget = self._max_scratch
        else:
            # Eager: the gathered pieces and as much scratch.
            budget = self._max_scratch // 2
            if self._device.type == "cpu":
                budget = min(budget, _EAGER_CPU_CHUNK_BYTES)
        return max(1, budget // layer.block_bytes)

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
        self, start: int, num_blocks: int, block_size: int, num_tokens: int
    ) -> torch.Tensor:
        """``A(t)`` of the tokens of ``num_blocks`` blocks from position
        ``start``, 0 at or past ``num_tokens``: [num_blocks, block_size]."""
        first = start * block_size
        count = num_blocks * block_size
        if len(self._position_table) < first + count:
            size = max(first + count, 2 * len(self._position_table), 1 << 12)
            table = position_weights(0, size).view(np.int64)
            self._position_table = self._to_device(table)
        weights = self._position_table[first : first + count]
        if num_tokens - first < count:
            weights = weights.clone()
            weights[max(0, num_tokens - first) :] = 0
        return weights.view(num_blocks, block_size)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """An int64 array on the device, without waiting for the copy."""
        tensor = torch.from_numpy(array)
        if self._device.type == "cpu":
            return tensor
        if self._device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self._device, non_blocking=True)

    def _flush(self, computed: list[_Computed]) -> None:
        """Start copying a pass's checksums to the host, as one array."""
        if not computed:
            return
        parts = [
            values.reshape(-1)
            for item in computed
            for _, _, values, _ in item.groups.values()
        ]
        flat = (
            torch.cat(parts)
            if parts
            else torch.empty(0, dtype=torch.int64, device=self._device)
        )
        if self._device.type != "cuda":
            self._batches.append(_Batch(computed, flat.cpu()))
            return
        host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self._device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._batches.append(_Batch(computed, host, event, flat))
