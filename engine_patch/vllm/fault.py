"""``KVGuardFaultInjectionConnector``: KVGuardConnector that corrupts loaded
KV on purpose, for tests and demos of what KVGuard catches.

It flips one bit of each chosen load's KV (or a state layer's state) after
the inner connector finishes the load and before KVGuard checksums it, as a
bad link, NIC or buggy transfer kernel would. Chosen by
``kv_connector_extra_config``::

    "fault_injection": {"loads": "every_other"}   # or "all", or
    "fault_injection": {"loads": "first", "count": 3}
    "fault_injection": {"loads": "all", "layers": "mamba"}  # states only
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from engine_patch.log import get_logger
from engine_patch.types import KVChecksumBlocks
from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.worker_side import KVGuardWorker
from engine_patch.worker import AnyLayer, KVStateLayer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from engine_patch.vllm.config import FaultSettings, KVGuardSettings

logger = get_logger(__name__)

# The bit flipped: the top bit of the first KV element of the load (the sign
# of a float's K), in the first token of its first block, first head.
_FLIP_MASK = 0x80


def flip_bit(kv: torch.Tensor, block_id: int) -> None:
    """Flip the top bit of element ``[block_id, 0, 0, 0]`` of a
    ``[blocks, heads, tokens, content]`` KV tensor, in place."""
    element = kv[block_id, 0, 0, :1]
    element.view(torch.uint8)[-1] ^= _FLIP_MASK


def flip_state_bit(state: torch.Tensor, block_id: int) -> None:
    """Flip the top bit of the first element of block ``block_id``'s state
    (a ``[blocks, ...]`` state tensor), in place."""
    element = state[block_id]
    while element.dim() > 1:
        element = element[0]
    element[:1].view(torch.uint8)[-1] ^= _FLIP_MASK


def _corrupt(layer: AnyLayer, block_id: int) -> None:
    """Flip a bit of ``layer``'s KV, or first state, in block ``block_id``."""
    if isinstance(layer, KVStateLayer):
        flip_state_bit(layer.states[0].state, block_id)
    else:
        flip_bit(layer.kv, block_id)


class FaultInjectingWorker(KVGuardWorker):
    """A KVGuard worker that corrupts the loads its settings choose."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: KVGuardSettings,
        faults: FaultSettings,
    ) -> None:
        super().__init__(vllm_config, kv_cache_config, settings)
        self._faults = faults
        self._num_loads = 0

    def before_checksum(self, loads: Mapping[str, KVChecksumBlocks]) -> None:
        for req_id, blocks in loads.items():
            self._num_loads += 1
            if not self._faults.corrupts(self._num_loads):
                continue
            for group_id, (start, block_ids) in sorted(blocks.groups.items()):
                layer = next(
                    (
                        layer
                        for layer in self.layers
                        if layer.group_id == group_id
                        and self._faults.layers in ("any", layer.spec_type)
                    ),
                    None,
                )
                if layer is not None and block_ids:
                    _corrupt(layer, block_ids[0])
                    logger.warning(
                        "Fault injection: flipped a bit of the KV load of request "
                        "%s (load %d, layer %s, block position %d).",
                        req_id,
                        self._num_loads,
                        layer.name,
                        start,
                    )
                    break


class KVGuardFaultInjectionConnector(KVGuardConnector):
    """KVGuardConnector with ``fault_injection`` in its extra config."""

    _injects_faults = True

    def _make_worker(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> KVGuardWorker:
        assert self._settings.fault_injection is not None
        return FaultInjectingWorker(
            vllm_config, kv_cache_config, self._settings, self._settings.fault_injection
        )
