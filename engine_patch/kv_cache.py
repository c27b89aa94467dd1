"""The host's KV cache layout as the checksum scheduler sees it: groups of
layers sharing one block table, and their specs.

The vLLM adapter builds these from vLLM's ``KVCacheConfig``; the fake engine
and tests build them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Attention layers holding KV for every token of the request."""

    block_size: int


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Attention layers holding KV only for the last ``sliding_window`` tokens."""

    block_size: int
    sliding_window: int


@dataclass(frozen=True)
class MambaSpec:
    """State-space layers: one running state per request, not KV per token.

    ``state_splits`` names how TP shards the state (``None``: unknown, so a
    rank's share depends on the TP size); ``tp_replicated`` states that every
    rank holds the whole state.
    """

    block_size: int
    num_speculative_blocks: int = 0
    state_splits: tuple[int, ...] | None = None
    tp_replicated: bool = False


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table."""

    kv_cache_spec: KVCacheSpec
    layer_names: tuple[str, ...] = ()


@dataclass(frozen=True, init=False)
class KVCacheConfig:
    """The engine's KV cache groups.

    ``transfer_group_ids`` are the groups P/D and offloading connectors move
    (and so the ones checksummed): every group if not given, none if empty
    (as vLLM's ``KVCacheConfig.transfer_group_ids``); ``hash_block_size`` is
    the token span of one entry of ``Request.block_hashes`` (``None``: the
    group's block size).
    """

    kv_cache_groups: Sequence[KVCacheGroup]
    transfer_group_ids: tuple[int, ...]
    hash_block_size: int | None

    def __init__(
        self,
        kv_cache_groups: Sequence[KVCacheGroup],
        transfer_group_ids: Sequence[int] | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        if transfer_group_ids is None:
            transfer_group_ids = range(len(kv_cache_groups))
        object.__setattr__(self, "kv_cache_groups", kv_cache_groups)
        object.__setattr__(self, "transfer_group_ids", tuple(transfer_group_ids))
        object.__setattr__(self, "hash_block_size", hash_block_size)


# Sliding-window groups are checksummed per this many tokens (per block where
# blocks are smaller), whatever their block size: a consumer drops the blocks
# that left its window in units of its own block size, so values per 16 tokens
# line up on both sides for block sizes 16, 32, 64, ... and the first kept
# block never starts inside a checksummed span.
SLIDING_WINDOW_CHECKSUM_TOKENS = 16


def checksum_tokens(spec_type: str, block_size: int) -> int:
    """Tokens per checksum value of a group: its block size, or
    :data:`SLIDING_WINDOW_CHECKSUM_TOKENS` for a sliding-window group with
    larger blocks (then a divisor of the block size), or 1 for a state
    group (one running state per request).

    ``spec_type`` is ``"full_attention"``, ``"sliding_window"`` or
    ``"mamba"`` (``engine_patch.worker.KVLayer.spec_type``).
    """
    if spec_type == "mamba":
        return 1
    span = SLIDING_WINDOW_CHECKSUM_TOKENS
    if spec_type == "sliding_window" and block_size > span and block_size % span == 0:
        return span
    return block_size


def checksum_spans(spec: KVCacheSpec) -> tuple[int, int]:
    """A group's checksum span: tokens per checksum value
    (:func:`checksum_tokens`) and values per block, 1 for a state group
    (its one running state)."""
    span = checksum_tokens(spec_type_of(spec), spec.block_size)
    if isinstance(spec, MambaSpec):
        return span, 1
    return span, spec.block_size // span


def spec_type_of(spec: KVCacheSpec) -> str:
    """The ``spec_type`` name of a spec (see :func:`checksum_tokens`)."""
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    return "full_attention"


def sliding_window_transfer_blocks(spec: KVCacheSpec) -> int:
    """How many of a request's last blocks P/D connectors transfer for a
    sliding-window group; 0 for other groups (all blocks).

    vLLM's NixlConnector moves ``cdiv(sliding_window, block_size) + 1``
    (its ``blocks_per_sw``): the window's blocks and one more for a window
    not aligned with them. Each of them is compared, even the one a window
    one token past whole blocks (17 tokens of 16-token blocks) never reads:
    a loaded block left unverified could be reused from the prefix cache.
    """
    if not isinstance(spec, SlidingWindowSpec):
        return 0
    return cdiv(spec.sliding_window, spec.block_size) + 1


def clip_ssm_state_blocks(
    block_ids: Sequence[int], num_speculative_blocks: int
) -> list[int]:
    """The running-state block of a Mamba group's non-null blocks: the last
    one before the speculative-decoding blocks."""
    end = max(1, len(block_ids) - num_speculative_blocks)
    return list(block_ids[end - 1 : end])
