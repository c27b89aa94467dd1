"""vLLM's objects as engine_patch's host types: its KV cache config as
:class:`engine_patch.kv_cache.KVCacheConfig`, its requests at a given
``num_computed_tokens``, the inner connector's hooks, and the KV tensors it
registers as :class:`engine_patch.worker.KVLayer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1 import kv_cache_interface as vllm_specs
from vllm.v1.metrics.cache_hit_source import CacheHitSource as VllmCacheHitSource

from engine_patch import kv_cache
from engine_patch.host import CacheHitSource
from engine_patch.log import get_logger
from engine_patch.vllm import states
from engine_patch.worker import AnyLayer, KVLayer, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.request import Request

logger = get_logger(__name__)

# vLLM's cache tiers as the checksum scheduler's sources. A connector that
# does not label its hits is a P/D connector here: KVGuard wraps those.
_SOURCES = {
    VllmCacheHitSource.P2P: CacheHitSource.P2P,
    VllmCacheHitSource.EXTERNAL_UNSPECIFIED: CacheHitSource.P2P,
    VllmCacheHitSource.HOST: CacheHitSource.OFFLOAD,
    VllmCacheHitSource.DISK: CacheHitSource.OFFLOAD,
}


class UnsupportedKVCacheError(ValueError):
    """A KV cache group or layer the checksums cannot cover."""


def spec_type(spec: vllm_specs.KVCacheSpec) -> str:
    """The spec's kind as the checksum's layer fingerprint names it."""
    if isinstance(spec, vllm_specs.SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, vllm_specs.MLAAttentionSpec):
        return "mla"
    if isinstance(spec, vllm_specs.MambaSpec):
        return "mamba"
    return "full_attention"


def _tp(vllm_config: VllmConfig | None) -> tuple[int, int | None]:
    """The TP size and the model's Mamba2 group count (1 and None without a
    config)."""
    if vllm_config is None:
        return 1, None
    return (
        vllm_config.parallel_config.tensor_parallel_size,
        states.model_n_groups(vllm_config),
    )


def _convert_spec(
    spec: vllm_specs.KVCacheSpec, vllm_config: VllmConfig | None
) -> kv_cache.KVCacheSpec | None:
    """engine_patch's spec of a vLLM spec, or None if checksums do not cover
    it: attention kinds whose blocks P/D connectors move differently, and
    state kinds other than :data:`states.SUPPORTED_STATE_TYPES`.

    A state group's TP splits are known (``state_splits``: each state split
    along dim 0) where :func:`states.state_shards` places the shares; without
    ``vllm_config`` they are taken as unknown (only peers of one TP size
    compare)."""
    if isinstance(spec, vllm_specs.SlidingWindowSpec):
        return kv_cache.SlidingWindowSpec(spec.block_size, spec.sliding_window)
    if type(spec) in (vllm_specs.FullAttentionSpec, vllm_specs.MLAAttentionSpec):
        return kv_cache.FullAttentionSpec(spec.block_size)
    if type(spec) is vllm_specs.MambaSpec and states.is_supported(spec):
        splits = None
        if vllm_config is not None:
            tp_size, n_groups = _tp(vllm_config)
            if states.state_shards(spec, tp_size, 0, n_groups) is not None:
                splits = (0,) * len(spec.shapes)
        return kv_cache.MambaSpec(
            spec.block_size,
            spec.num_speculative_blocks,
            state_splits=splits,
            tp_replicated=spec.tp_replicated,
        )
    return None


def convert_kv_cache_config(
    config: vllm_specs.KVCacheConfig,
    *,
    fail_closed: bool,
    vllm_config: VllmConfig | None = None,
) -> kv_cache.KVCacheConfig:
    """The groups the checksums cover: vLLM's transfer groups of supported
    kinds (``vllm_config``: see :func:`_convert_spec`).

    Raises:
        UnsupportedKVCacheError: Under fail-closed, if a transfer group is of
            a kind checksums do not cover (its loads could never verify);
            fail-open leaves it out with a warning.

    """
    groups: list[kv_cache.KVCacheGroup] = []
    covered: list[int] = []
    for group_id, group in enumerate(config.kv_cache_groups):
        spec = _convert_spec(group.kv_cache_spec, vllm_config)
        # Placeholder for uncovered groups: never scheduled.
        groups.append(
            kv_cache.KVCacheGroup(
                spec or kv_cache.FullAttentionSpec(group.kv_cache_spec.block_size),
                tuple(group.layer_names),
            )
        )
        if group_id not in config.transfer_group_ids:
            continue
        if spec is None:
            kind = type(group.kv_cache_spec).__name__
            if fail_closed:
                raise UnsupportedKVCacheError(
                    f"KV cache group {group_id} is a {kind}, which KVGuard "
                    "cannot checksum; its loads would never verify "
                    "(use fail_closed: false to leave it unchecked)"
                )
            logger.warning(
                "KVGuard does not checksum KV cache group %d (%s).", group_id, kind
            )
            continue
        covered.append(group_id)
    return kv_cache.KVCacheConfig(
        kv_cache_groups=groups,
        transfer_group_ids=covered,
        hash_block_size=config.hash_block_size,
    )


@dataclass(frozen=True)
class RequestAt:
    """A vLLM request as the checksum scheduler sees it with
    ``num_computed_tokens`` of the caller's choosing: vLLM counts a step's
    tokens, or a load's, only after the connector hears of them."""

    request: Request
    num_computed_tokens: int

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self.request.kv_transfer_params

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self.request.block_hashes

    def get_finished_reason(self) -> int | None:
        return self.request.get_finished_reason()


class ConnectorHooks:
    """The inner connector's hooks as the checksum scheduler calls them
    (``engine_patch.host.KVChecksumConnector``)."""

    def __init__(self, inner: KVConnectorBase_V1) -> None:
        self._inner = inner

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> Mapping[CacheHitSource, int]:
        vllm_request = request.request if isinstance(request, RequestAt) else request
        sources: dict[CacheHitSource, int] = {}
        for source, count in self._inner.get_external_cache_hit_sources(
            vllm_request, num_external_tokens
        ).items():
            if count and (mapped := _SOURCES.get(source)) is not None:
                sources[mapped] = sources.get(mapped, 0) + count
        return sources

    def get_kv_checksum_sources(self, request: Any) -> Set[CacheHitSource]:
        # vLLM's connectors do not offload checksums with KV.
        return frozenset()

    def on_kv_checksum_failure(
        self, request: Any, mismatches: dict[int, list[int]]
    ) -> None:
        # Only loads of offloaded KV with checksums get here; see above.
        logger.error(
            "KV checksum failure of offloaded KV for request %s: %s",
            request.request_id,
            mismatches,
        )


def _layer_coordinates(
    vllm_config: VllmConfig, spec: vllm_specs.KVCacheSpec, tp_rank: int
) -> tuple[int, int, int]:
    """``(head_offset, replicas, replica_index)`` of this TP rank's KV heads
    (vLLM replicates KV heads when TP exceeds them, and MLA's one latent on
    every rank)."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if isinstance(spec, vllm_specs.MLAAttentionSpec):
        return 0, tp_size, tp_rank
    assert isinstance(spec, vllm_specs.AttentionSpec)
    total = vllm_config.model_config.get_total_num_kv_heads()
    if total >= tp_size:
        return tp_rank * spec.num_kv_heads, 1, 0
    replicas = tp_size // total
    return tp_rank // replicas, replicas, tp_rank % replicas


def kv_layers(
    vllm_config: VllmConfig,
    kv_cache_config: vllm_specs.KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    *,
    covered_groups: Set[int],
    tp_rank: int,
) -> list[AnyLayer]:
    """The registered KV tensors of the covered groups as checksum layers.

    vLLM 0.32 hands each attention layer a view whose logical shape is
    ``[blocks, heads, block_size, content]`` (content: K then V, or MLA's
    latent) with any strides: :attr:`KVLayout.PACKED_HND`; each state layer
    ``[blocks, 1, 1, page bytes]`` int8 pages (:func:`states.state_layer`).

    Raises:
        UnsupportedKVCacheError: If a covered layer's tensor is missing or
            does not have that shape (e.g. kernel blocks smaller than the
            KV cache's).

    """
    from vllm.model_executor.models.utils import extract_layer_index

    total_num_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    tp_size, n_groups = _tp(vllm_config)
    layers: list[AnyLayer] = []
    for group_id in sorted(covered_groups):
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = group.kv_cache_spec
        if isinstance(spec, vllm_specs.MambaSpec):
            shards = states.state_shards(spec, tp_size, tp_rank, n_groups)
            for name in group.layer_names:
                pages = kv_caches.get(name)
                if pages is None:
                    raise UnsupportedKVCacheError(
                        f"layer {name} registered no state cache"
                    )
                try:
                    layer = states.state_layer(
                        name,
                        extract_layer_index(name),
                        group_id,
                        pages,
                        spec,
                        shards,
                        tp_size=tp_size,
                        tp_rank=tp_rank,
                    )
                except ValueError as e:
                    raise UnsupportedKVCacheError(f"layer {name}: {e}") from e
                layers.append(layer)
            continue
        assert isinstance(spec, vllm_specs.AttentionSpec)
        head_offset, replicas, replica_index = _layer_coordinates(
            vllm_config, spec, tp_rank
        )
        for name in group.layer_names:
            kv = kv_caches.get(name)
            if kv is None:
                raise UnsupportedKVCacheError(f"layer {name} registered no KV cache")
            expected = (spec.num_kv_heads, spec.block_size)
            if kv.dim() != 4 or tuple(kv.shape[1:3]) != expected:
                raise UnsupportedKVCacheError(
                    f"layer {name}: KV tensor {list(kv.shape)} is not "
                    f"[blocks, {expected[0]} heads, {expected[1]} tokens, content]"
                )
            layers.append(
                KVLayer(
                    name=name,
                    index=extract_layer_index(name),
                    group_id=group_id,
                    kv=kv,
                    layout=KVLayout.PACKED_HND,
                    spec_type=spec_type(spec),
                    head_offset=head_offset,
                    replicas=replicas,
                    replica_index=replica_index,
                    total_num_kv_heads=total_num_kv_heads,
                )
            )
    return layers
