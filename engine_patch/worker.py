"""Worker-side KV checksums (torch): the partial checksums of ``checksum.md``
over the KV tensors one TP rank of one PP stage holds.

API contract (implementation in progress; see issue 2). The host engine's
worker (vLLM's worker-side connector, the fake engine's simulated TP
workers) drives it once per step::

    worker = KVChecksumWorker(layers, tp_rank=r, pp_rank=s)
    worker.begin_step(scheduled)   # the scheduler's KVChecksumScheduled, or None
    ...forward pass writes KV...
    worker.after_forward()         # checksums this step's sends
    worker.on_loads_finished(ids)  # checksums finished recvs/loads, before
                                   # any later step can write their blocks
    record = worker.take_record()  # KVChecksumRecord for the scheduler, or None
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_patch.types import KVChecksumBlocks, KVChecksumRecord, KVChecksumScheduled


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


class KVChecksumWorker:
    """Checksums the blocks the scheduler asks for, on one worker."""

    def __init__(
        self,
        layers: Sequence[KVLayer],
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        max_scratch_bytes: int = 64 << 20,
    ) -> None:
        raise NotImplementedError

    @property
    def skipped_groups(self) -> frozenset[int]:
        """Groups this worker cannot checksum."""
        raise NotImplementedError

    @property
    def fingerprints(self) -> dict[int, int]:
        """Per group, the sum of its layers' fingerprints on this worker."""
        raise NotImplementedError

    def begin_step(self, scheduled: KVChecksumScheduled | None) -> None:
        """Take the step's scheduled requests."""
        raise NotImplementedError

    def after_forward(self) -> None:
        """Checksum the sends scheduled this step (their KV is now final)."""
        raise NotImplementedError

    def on_loads_finished(self, req_ids: Iterable[str]) -> None:
        """Checksum the blocks of these finished recvs and loads."""
        raise NotImplementedError

    def add_received(self, req_id: str, data: bytes) -> None:
        """A producer payload the connector received with a load."""
        raise NotImplementedError

    def set_stored(self, req_id: str, stored: Mapping[int, np.ndarray]) -> None:
        """The per-block values offloaded with the KV a load brings back."""
        raise NotImplementedError

    def request_finished(self, req_ids: Iterable[str]) -> None:
        """Drop state of requests that finished (or were aborted)."""
        raise NotImplementedError

    def take_record(self) -> KVChecksumRecord | None:
        """This step's report, or None if it has nothing to report; waits for
        values still being copied from the device."""
        raise NotImplementedError

    def init_block_checksums(
        self, blocks: KVChecksumBlocks, block_hashes: Mapping[int, Sequence[bytes]]
    ) -> dict[int, np.ndarray]:
        """Per group, the value to offload with each block: the sum of its
        replica columns XOR ``block_checksum_tags`` of its block hash."""
        raise NotImplementedError
