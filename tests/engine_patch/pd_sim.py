"""Two engines' checksum schedulers and workers over small torch KV caches,
with a simulated KV transfer that copies blocks to other block ids.

KV moves in a layout-free form, per group a uint8 tensor ``[layers, tokens,
heads, cell_bytes]`` (a cell: K bytes then V bytes, as ``checksum.md``
defines it); each engine scatters it into its own workers' caches (its TP
shards, PP stages, block size, layout and block ids) and gathers it back.
Corruptions are applied to that form between the producer's read and the
consumer's write, or to a consumer cache directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

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
    SlidingWindowSpec,
    cdiv,
    sliding_window_transfer_blocks,
)
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.types import KVChecksumBlocks, KVChecksumRecord
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

# Per group: uint8 [layers of the group, tokens, KV heads, cell bytes].
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


@dataclass(frozen=True)
class ModelShape:
    """What both engines serve: KV heads and groups of layers."""

    num_kv_heads: int = 2
    groups: tuple[GroupShape, ...] = (GroupShape(layers=(0, 1, 2, 3)),)

    @property
    def num_layers(self) -> int:
        return 1 + max(layer for group in self.groups for layer in group.layers)

    def random_kv(self, seed: int, num_tokens: int) -> KV:
        rng = np.random.default_rng(seed)
        return {
            g: rng.integers(
                0,
                256,
                (len(group.layers), num_tokens, self.num_kv_heads, group.cell_bytes),
                dtype=np.uint8,
            )
            for g, group in enumerate(self.groups)
        }


@dataclass
class _Cache:
    """One layer's KV on one worker."""

    layer: KVLayer
    group_id: int
    # The layer's position in its group (the KV form's first dim).
    slot: int
    heads: slice


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
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tp, self.pp = tp, pp
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.connector = connector or FakeConnector()
        specs = [
            FullAttentionSpec(block_size)
            if group.sliding_window is None
            else SlidingWindowSpec(block_size, group.sliding_window)
            for group in model.groups
        ]
        self.kv_cache_config = KVCacheConfig(
            [
                KVCacheGroup(spec, tuple(_layer_name(i) for i in group.layers))
                for spec, group in zip(specs, model.groups, strict=True)
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
            group.sliding_window is None for group in model.groups
        ), "prefix caching of full-attention groups only"
        self.prefix_caching = prefix_caching
        self.cached: dict[tuple[str, int], list[int]] = {}
        self.caches: dict[Worker, list[_Cache]] = {}
        self.workers: dict[Worker, KVChecksumWorker] = {}
        for pp_rank, tp_rank in itertools.product(range(pp), range(tp)):
            caches = self._make_caches(pp_rank, tp_rank, layout)
            self.caches[pp_rank, tp_rank] = caches
            self.workers[pp_rank, tp_rank] = KVChecksumWorker(
                [c.layer for c in caches], tp_rank=tp_rank, pp_rank=pp_rank
            )

    def _make_caches(
        self, pp_rank: int, tp_rank: int, layout: KVLayout
    ) -> list[_Cache]:
        model = self.model
        heads = model.num_kv_heads
        layers_per_stage = cdiv(model.num_layers, self.pp)
        stage = range(pp_rank * layers_per_stage, (pp_rank + 1) * layers_per_stage)
        if self.tp <= heads:
            local = heads // self.tp
            head_offset, replicas, replica_index = tp_rank * local, 1, 0
        else:
            local, replicas = 1, self.tp // heads
            head_offset, replica_index = tp_rank // replicas, tp_rank % replicas
        caches = []
        for g, group in enumerate(model.groups):
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
                    name=_layer_name(index),
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
    ) -> FakeBlocks:
        """Random free block ids for the request after its ``cached``
        prefix's blocks (a block id per group each); a sliding-window group's
        blocks out of its window are null."""
        count = cdiv(num_tokens, self.block_size)
        groups = []
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            keep = sliding_window_transfer_blocks(group.kv_cache_spec) or count
            num_null = max(0, count - keep)
            free = self._free[g]
            prefix = [ids[g] for ids in cached]
            picked = self.rng.choice(
                len(free), count - num_null - len(prefix), replace=False
            )
            ids = [free[i] for i in picked]
            taken = set(picked.tolist())
            self._free[g] = [b for i, b in enumerate(free) if i not in taken]
            groups.append([None] * num_null + prefix + ids)
        blocks = FakeBlocks.of(*groups)
        self.manager.by_request[req_id] = blocks
        return blocks

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
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per group, ``_token_slots`` of ``[start, end)``."""
        return [
            self._token_slots(blocks, g, start, end)
            for g in range(len(self.model.groups))
        ]

    def write(self, blocks: FakeBlocks, kv: KV, start: int, end: int) -> None:
        """Scatter tokens ``[start, end)`` of ``kv`` (indexed from
        ``start``) into every worker's caches: the forward pass, or a load."""
        slots = self._slots(blocks, start, end)
        for caches in self.caches.values():
            for cache in caches:
                tokens, ids, offsets = slots[cache.group_id]
                data = kv[cache.group_id][cache.slot, tokens - start, cache.heads]
                view = _cells(cache.layer.kv, cache.layer.layout)
                view[ids, offsets] = data.reshape((len(ids), *view.shape[2:]))

    def read(self, blocks: FakeBlocks, start: int, end: int) -> KV:
        """Gather tokens ``[start, end)`` back (zeros where a block is null),
        from the ranks holding replica 0."""
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
        return out

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

    # --- Producer and consumer ----------------------------------------------------

    def prefill(
        self, req_id: str, kv: KV, num_tokens: int
    ) -> tuple[FakeRequest, FakeBlocks]:
        """A producer request's prefill, in one step."""
        req = producer_request(req_id, num_tokens)
        blocks = self.allocate(req_id, num_tokens)
        req.num_computed_tokens = num_tokens
        self.write(blocks, kv, 0, num_tokens)
        self.scheduler.add_send(req, num_tokens, self.manager)
        assert self.step() == set()
        return req, blocks


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
    producer_blocks: FakeBlocks = field(init=False)
    params: dict[str, object] = field(init=False)
    # After the load: the tokens the consumer had cached, and the KV its
    # caches hold for the request (what it decodes from).
    num_cached_tokens: int = field(init=False, default=0)
    seen: KV = field(init=False, default_factory=dict)

    def prefill(self, reason: FinishReason = FinishReason.STOP) -> dict[str, object]:
        req, self.producer_blocks = self.producer.prefill(
            self.req_id, self.kv, self.num_tokens
        )
        self.params = self.producer.finish(req, reason)
        return self.params

    def load(
        self,
        *,
        params: Mapping[str, object] | None = None,
        num_local_tokens: int = 0,
        corrupt: Corruption | None = None,
        corrupt_cache: Callable[[SimEngine, FakeBlocks], None] | None = None,
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
        consumer = self.consumer
        req = consumer_request(
            self.req_id, self.num_tokens, self.params if params is None else params
        )
        consumer.scheduler.on_new_request(req)
        hit = consumer.cache_hit(self.prompt, self.num_tokens)
        blocks = consumer.allocate(self.req_id, self.num_tokens, hit)
        if hit:
            num_local_tokens = len(hit) * consumer.block_size
        elif num_local_tokens:
            # The cached prefix holds the same KV, computed locally.
            consumer.write(blocks, self.kv, 0, num_local_tokens)
        self.num_cached_tokens = num_local_tokens
        req.num_computed_tokens = self.num_tokens
        consumer.scheduler.add_recv(req, blocks, num_local_tokens)

        def copy() -> None:
            data = self.producer.read(
                self.producer_blocks, num_local_tokens, self.num_tokens
            )
            if corrupt is not None:
                corrupt(data)
            consumer.write(blocks, data, num_local_tokens, self.num_tokens)
            if corrupt_cache is not None:
                corrupt_cache(consumer, blocks)

        failed = consumer.step(finished_loads=[self.req_id], load=copy, ranks=ranks)
        self.seen = consumer.read(blocks, 0, self.num_tokens)
        mismatched = consumer.scheduler.take_mismatched_loads()
        if consumer.prefix_caching and self.req_id not in failed | set(mismatched):
            consumer.cache(self.prompt, blocks, self.num_tokens)
        consumer.finish(req)
        consumer.free(self.req_id)
        self.producer.free(self.req_id)
        return failed


def transfer(
    producer: SimEngine,
    consumer: SimEngine,
    num_tokens: int,
    *,
    seed: int = 0,
    req_id: str = "req",
) -> Transfer:
    """A prefilled transfer of random KV (the prompt ``seed``'s)."""
    kv = producer.model.random_kv(seed, num_tokens)
    t = Transfer(producer, consumer, num_tokens, kv, req_id, prompt=f"seed{seed}")
    t.prefill()
    return t


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
    """Prefill a request and offload its full blocks with their checksums."""
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


def _layer_name(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


__all__ = [
    "KV_TRANSFER_PARAMS_KEY",
    "GroupShape",
    "ModelShape",
    "Offloaded",
    "SimEngine",
    "Transfer",
    "block_hashes",
    "offload",
    "offload_engine",
    "reload",
    "transfer",
]
