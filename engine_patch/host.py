"""What the checksum scheduler takes from its host engine, as protocols that
vLLM's own objects satisfy (``vllm.v1.request.Request``,
``KVCacheManager``, ...) and the fake engine's and tests' small types too.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence, Set
from typing import Any, Protocol

from engine_patch.types import KVChecksumRecord


class FinishReason(enum.IntEnum):
    """Why a request finished; the values are vLLM's ``FinishReason``."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3


# Finishes whose KV a producer sends (NixlConnector's request_finished); an
# aborted or failed request's is not.
KV_SENT_FINISH_REASONS = frozenset({FinishReason.STOP, FinishReason.LENGTH})


class CacheHitSource(enum.Enum):
    """Where a connector loads a request's external cache hit from."""

    # A remote producer instance (P/D disaggregation).
    P2P = "p2p"
    # An offload tier of this instance (CPU memory, disk, ...).
    OFFLOAD = "offload"


# The null block's id (a block out of a sliding window): vLLM's block pool
# makes its first block the null block.
NULL_BLOCK_ID = 0


class Block(Protocol):
    """A KV cache block (vLLM's ``KVCacheBlock``); the null block's id is
    ``NULL_BLOCK_ID``, and no other block's."""

    @property
    def block_id(self) -> int: ...

    @property
    def is_null(self) -> bool: ...


# A request's block ids per KV cache group, as a host's scheduler lists them
# for its workers (vLLM's ``NewRequestData.block_ids``).
BlockIds = Sequence[Sequence[int]]


class KVCacheBlocks(Protocol):
    """A request's blocks, one sequence per KV cache group."""

    @property
    def blocks(self) -> Sequence[Sequence[Block]]: ...


class KVCacheManager(Protocol):
    """Gives a request's blocks."""

    def get_blocks(self, request_id: str) -> KVCacheBlocks: ...


class Request(Protocol):
    """A request as the scheduler tracks it.

    ``num_computed_tokens`` counts tokens whose KV is in the cache or
    scheduled this step; ``block_hashes`` are the prefix hashes of its full
    blocks of ``hash_block_size`` tokens.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    def get_finished_reason(self) -> int | None: ...


class KVChecksumConnector(Protocol):
    """The connector hooks the checksum scheduler calls."""

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> Mapping[CacheHitSource, int]:
        """Where the ``num_external_tokens`` tokens of the request's external
        cache hit are loaded from, and how many tokens from each; empty if
        none are loaded."""
        ...

    def get_kv_checksum_sources(self, request: Request) -> Set[CacheHitSource]:
        """The sources whose loads carry checksums stored with the KV."""
        ...

    def on_kv_checksum_failure(
        self, request: Request, mismatches: dict[int, list[int]]
    ) -> None:
        """A load of offloaded KV failed verification: ``mismatches`` has the
        bad block positions per group (empty: it could not be compared)."""
        ...


class KVConnectorOutput(Protocol):
    """The step's aggregated connector output, as far as checksums go."""

    @property
    def kv_checksums(self) -> Sequence[KVChecksumRecord] | None: ...

    @property
    def finished_recving(self) -> Collection[str] | None: ...
