"""The messages between the checksum scheduler and its workers.

The scheduler sends each step a :class:`KVChecksumScheduled` (the blocks to
checksum); every worker answers with a :class:`KVChecksumRecord` (its partial
checksums, see ``docs/checksum.md``), which the scheduler sums and compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# (replicas, replica_index): which copy of replicated KV heads a checksum
# column covers. (1, 0) for heads held by one rank only.
ReplicaKey = tuple[int, int]


def num_valid_tokens(block: int, block_size: int, num_tokens: int) -> int:
    """Tokens of block position ``block`` that hold KV when a request has
    ``num_tokens`` tokens."""
    return max(0, min(block_size, num_tokens - block * block_size))


@dataclass
class KVChecksumBlocks:
    """The blocks of one request to checksum.

    ``groups`` maps a KV cache group id to the position of its first block
    and the ids of consecutive blocks from there; only tokens below
    ``num_tokens`` count.
    """

    num_tokens: int
    groups: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


@dataclass
class KVChecksumScheduled:
    """What the workers checksum for the scheduler, by request id.

    - ``reqs_to_send``: a producer's prompt KV, after this step's forward.
    - ``reqs_to_recv``: blocks a load from a producer writes, once it finishes.
    - ``reqs_to_load``: blocks a load of offloaded KV writes, once it
      finishes; compared with the checksums offloaded with them.
    """

    reqs_to_send: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_recv: dict[str, KVChecksumBlocks] = field(default_factory=dict)
    reqs_to_load: dict[str, KVChecksumBlocks] = field(default_factory=dict)


@dataclass
class KVChecksumGroup:
    """One worker's checksums of one request's blocks in one group.

    ``values[i, j]`` is the partial checksum of span ``start + i`` over the
    layers and heads with replica key ``replica_keys[j]``. A span is
    ``kv_cache.checksum_tokens(spec_type, block_size)`` tokens: a block, or
    for sliding-window groups with blocks over 16 tokens a 16-token part of
    one (block position ``p`` of ``KVChecksumBlocks`` then gives spans
    ``p * k`` to ``p * k + k - 1``, ``k = block_size // 16``), or for state
    groups the one running state at span 0.
    ``stored`` (loads of offloaded KV only) holds, per block (not span), the
    value the worker offloaded with it: the sum of the block's spans and
    replica columns, tagged (``KVChecksumWorker.init_block_checksums``).
    """

    start: int
    replica_keys: list[ReplicaKey]
    values: np.ndarray  # uint64 [num_spans, len(replica_keys)]
    stored: np.ndarray | None = None  # uint64 [num_blocks]


@dataclass
class KVChecksumRecord:
    """A worker's report for one step.

    ``checksums``: per request id, per group id, its checksums.
    ``skipped_groups``: groups this worker cannot checksum (e.g. cells that
    are not a whole number of 8-byte pieces).
    ``fingerprints``: per group id, the identity of its layers on this
    worker (``docs/checksum.md``).
    ``received``: producer payloads the connector received with a load, per
    request id, for connectors that send checksums in their own messages.
    """

    pp_rank: int
    tp_rank: int
    checksums: dict[str, dict[int, KVChecksumGroup]] = field(default_factory=dict)
    skipped_groups: frozenset[int] = frozenset()
    fingerprints: dict[int, int] = field(default_factory=dict)
    received: dict[str, bytes] = field(default_factory=dict)
