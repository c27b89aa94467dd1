"""The fake engine's simulated TP workers: each holds its share of KV heads
of every layer in paged torch tensors, and runs an engine_patch
``KVChecksumWorker`` over them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from engine_patch.types import KVChecksumRecord, KVChecksumScheduled
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout
from fake_engine.config import EngineConfig

_T = TypeVar("_T")


def layer_name(index: int) -> str:
    """The model-wide name of attention layer ``index``, as vLLM names it."""
    return f"model.layers.{index}.self_attn.attn"


class TPWorker:
    """One TP rank: KV heads ``heads`` (global indices) of every layer, copy
    ``replica_index`` of ``replicas`` when TP exceeds the KV heads.

    The cache is ``[layers, 2, num_blocks, block_size, heads, head_size]``
    (each layer's view is vLLM's split K/V layout).
    """

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.rank = rank
        self.total_num_kv_heads = config.kv_heads
        self.replicas = config.head_replicas
        self.replica_index = rank % self.replicas
        heads_per_rank = config.heads_per_rank
        self.head_offset = (rank // self.replicas) * heads_per_rank
        self.heads = torch.arange(self.head_offset, self.head_offset + heads_per_rank)
        self.block_size = config.block_size
        self.kv = torch.zeros(
            (
                config.layers,
                2,
                config.num_blocks,
                config.block_size,
                heads_per_rank,
                config.head_size,
            ),
            dtype=config.cache_dtype,
        )
        # Slots flattened: [layers, 2, num_blocks * block_size, heads, head_size].
        self._slots_view = self.kv.view(
            config.layers, 2, -1, heads_per_rank, config.head_size
        )
        self.checksums: KVChecksumWorker | None = None
        if config.kv_checksums:
            # Eager unless KVGUARD_CHECKSUM_COMPILE=1: on a fake engine's small
            # passes the fused kernel saves little (one request's pass is
            # mostly per-call overhead either way; it pays off from several
            # requests a pass), and its compile (20-45 s on a CPU, per
            # process and KV shape) would land in tests.
            self.checksums = KVChecksumWorker(self.kv_layers(), tp_rank=rank)
        # Checksum work so far, exported like vLLM's connector does (throughput).
        self.checksum_bytes = 0
        self.checksum_seconds = 0.0
        self._block_bytes = self.kv[:, :, 0].numel() * self.kv.element_size()

    def kv_layers(self) -> list[KVLayer]:
        """This rank's layers as engine_patch sees them."""
        return [
            KVLayer(
                name=layer_name(index),
                index=index,
                group_id=0,
                kv=self.kv[index],
                layout=KVLayout.SPLIT,
                head_offset=self.head_offset,
                replicas=self.replicas,
                replica_index=self.replica_index,
                total_num_kv_heads=self.total_num_kv_heads,
            )
            for index in range(self.kv.shape[0])
        ]

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write KV of all heads (``[tokens, layers, heads, 2, head_size]``)
        into ``slots``; this rank keeps its heads."""
        mine = kv[:, :, self.heads]
        self._slots_view[:, :, slots] = mine.permute(1, 3, 0, 2, 4)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """This rank's KV in ``slots``: ``[tokens, layers, heads, 2, head_size]``."""
        return self._slots_view[:, :, slots].permute(2, 0, 3, 1, 4)

    # The checksum worker's step hooks, no-ops without checksums.

    def begin_step(
        self, finished_req_ids: set[str], scheduled: KVChecksumScheduled | None
    ) -> None:
        checksums = self.checksums
        if checksums is not None:
            if scheduled is not None:
                self._count_bytes(scheduled)
            if finished_req_ids:
                checksums.request_finished(finished_req_ids)
            self._timed(lambda: checksums.begin_step(scheduled))

    def after_forward(self) -> None:
        if self.checksums is not None:
            self._timed(self.checksums.after_forward)

    def on_loads_finished(self, req_ids: set[str]) -> None:
        checksums = self.checksums
        if checksums is not None and req_ids:
            self._timed(lambda: checksums.on_loads_finished(req_ids))

    def take_record(self) -> KVChecksumRecord | None:
        if self.checksums is None:
            return None
        return self._timed(self.checksums.take_record)

    def _count_bytes(self, scheduled: KVChecksumScheduled) -> None:
        """KV this rank checksums for the step's sends and (finishing) loads."""
        for reqs in (
            scheduled.reqs_to_send,
            scheduled.reqs_to_recv,
            scheduled.reqs_to_load,
        ):
            for blocks in reqs.values():
                for _, block_ids in blocks.groups.values():
                    self.checksum_bytes += len(block_ids) * self._block_bytes

    def _timed(self, fn: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.checksum_seconds += time.perf_counter() - start
