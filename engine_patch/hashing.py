"""The fixed constants of checksum v1 (``docs/checksum.md``): weights, the
``mix`` bijection, layer fingerprints and offload tags.

Plain Python and NumPy, so the scheduler needs no torch; the worker builds
its torch tables from these functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

MASK64 = (1 << 64) - 1

# Disjoint index ranges of the weight factors S, A and Q.
_S_DOMAIN = 1 << 62
_A_DOMAIN = 2 << 62
_Q_DOMAIN = 3 << 62
# Global KV heads per layer the S index leaves room for.
_MAX_HEADS = 1 << 24

# murmur3's fmix64 multipliers.
MIX_C1 = 0xFF51AFD7ED558CCD
MIX_C2 = 0xC4CEB9FE1A85EC53


def splitmix64(i: int) -> int:
    """splitmix64's output for state ``i``: a fixed 64-bit hash of an index."""
    z = (i + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def layer_head_weight(layer: int, head: int) -> int:
    """``S(l, h)``: odd weight of a model-wide layer and global KV head."""
    return splitmix64(_S_DOMAIN | layer * _MAX_HEADS + head) | 1


def position_weight(token: int) -> int:
    """``A(t)``: odd weight of a token's absolute position."""
    return splitmix64(_A_DOMAIN | token) | 1


def position_weights(start: int, stop: int) -> np.ndarray:
    """``A(t)`` for ``start <= t < stop`` at once (uint64): what
    :func:`position_weight` gives, vectorised for long requests."""
    z = np.arange(start, stop, dtype=np.uint64) | np.uint64(_A_DOMAIN)
    # uint64 array arithmetic wraps modulo 2^64, as splitmix64 needs.
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def piece_weight(piece: int) -> int:
    """``Q(p)``: odd weight of a cell's 8-byte piece."""
    return splitmix64(_Q_DOMAIN | piece) | 1


def mix(x: int) -> int:
    """``mix``: murmur3's fmix64, a bijection of 64-bit words."""
    x ^= x >> 33
    x = (x * MIX_C1) & MASK64
    x ^= x >> 33
    x = (x * MIX_C2) & MASK64
    return x ^ (x >> 33)


def hash64(*parts: object) -> int:
    """A stable 64-bit hash of the parts' text (blake2b)."""
    text = "\x1f".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def layer_fingerprint(
    name: str,
    spec_type: str,
    dtype: str,
    cell_bytes: int,
    *,
    total_num_kv_heads: int | None = None,
) -> int:
    """One layer's share of its group's fingerprint: every fact that makes
    two sides' sums incomparable. Its name (summed over a group's layers, the
    sum also tells which and how many layers), spec type, dtype, bytes per
    cell (with the dtype: the head size, K and V) and the model's KV heads
    across all TP ranks (None: the host does not say; such a layer matches
    only another that does not either). Block size and TP size are left out
    on purpose: the checksum does not depend on them, and producer and
    consumer may differ."""
    return hash64(
        "kvguard-layer-v2", name, spec_type, dtype, cell_bytes, total_num_kv_heads
    )


def block_checksum_tags(block_hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
    """Per block, the tag tying an offloaded checksum to the block's identity
    (its prefix hash) and its group's layers: like T10-DIF's reference tag."""
    key = fingerprint.to_bytes(8, "little")
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(bytes(h), digest_size=8, key=key).digest(), "little"
            )
            for h in block_hashes
        ],
        dtype=np.uint64,
    )
