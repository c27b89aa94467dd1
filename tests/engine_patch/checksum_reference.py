"""A slow, independent reference of checksum v1 (``docs/checksum.md``): plain
Python integers, one piece at a time, straight from the definition.

It shares only the definition's constants (``hashing``'s scalar weight and
``mix`` functions) with the code under test, none of the worker's torch code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_patch.hashing import layer_head_weight, mix, piece_weight, position_weight
from engine_patch.worker import KVLayer, KVLayout

MOD = 1 << 64


def _bytes(t: torch.Tensor) -> bytes:
    """The bytes of a 1-D tensor's elements, in index order."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def cell(layer: KVLayer, block_id: int, token: int, head: int) -> bytes:
    """One cell: the K bytes then the V bytes of a token of a local head."""
    kv = layer.kv
    if layer.layout is KVLayout.SPLIT:
        return _bytes(kv[0, block_id, token, head]) + _bytes(
            kv[1, block_id, token, head]
        )
    if layer.layout is KVLayout.PACKED_HND:
        return _bytes(kv[block_id, head, token])
    return _bytes(kv[block_id, token, head])


def block_size_of(layer: KVLayer) -> int:
    return (
        layer.kv.shape[2]
        if layer.layout is not KVLayout.PACKED_NHD
        else layer.kv.shape[1]
    )


def heads_of(layer: KVLayer) -> int:
    if layer.layout is KVLayout.SPLIT:
        return layer.kv.shape[3]
    return (
        layer.kv.shape[1] if layer.layout is KVLayout.PACKED_HND else layer.kv.shape[2]
    )


def layer_checksums(
    layer: KVLayer,
    start: int,
    block_ids: Sequence[int],
    num_tokens: int,
    span: int | None = None,
) -> list[int]:
    """``c(g, b)`` restricted to one layer, for blocks at positions from
    ``start``: Σ S(l, h)·A(t)·Q(p)·mix(x(t, l, h, p)) mod 2^64; with
    ``span``, one value per ``span`` tokens of each block instead."""
    block_size = block_size_of(layer)
    span = span or block_size
    out = []
    for i, block_id in enumerate(block_ids):
        for first in range(0, block_size, span):
            total = 0
            for j in range(first, first + span):
                t = (start + i) * block_size + j
                if t >= num_tokens:
                    continue
                for h in range(heads_of(layer)):
                    data = cell(layer, block_id, j, h)
                    assert len(data) % 8 == 0
                    s = layer_head_weight(layer.index, layer.head_offset + h)
                    for p in range(len(data) // 8):
                        x = int.from_bytes(data[8 * p : 8 * p + 8], "little")
                        total += s * position_weight(t) * piece_weight(p) * mix(x)
            out.append(total % MOD)
    return out


def checksums(
    layers: Sequence[KVLayer],
    start: int,
    block_ids: Sequence[int],
    num_tokens: int,
    span: int | None = None,
) -> list[int]:
    """Sum of :func:`layer_checksums` over ``layers``."""
    totals: list[int] = []
    for layer in layers:
        values = layer_checksums(layer, start, block_ids, num_tokens, span)
        totals = [
            (a + b) % MOD
            for a, b in zip(totals or [0] * len(values), values, strict=True)
        ]
    return totals


def state_checksum(index: int, states: Sequence[torch.Tensor]) -> int:
    """``c(g, 0)`` of one state layer (``docs/checksum.md``, "State groups"), from
    its unsharded states (one block's): Σ S(index, s)·A(0)·Q(p)·mix(x) over
    each state ``s``'s 8-byte pieces ``p``, zero-padded at its end."""
    total = 0
    for s, state in enumerate(states):
        data = _bytes(state.flatten())
        data += b"\0" * (-len(data) % 8)
        weight = layer_head_weight(index, s) * position_weight(0)
        for p in range(len(data) // 8):
            x = int.from_bytes(data[8 * p : 8 * p + 8], "little")
            total += weight * piece_weight(p) * mix(x)
    return total % MOD
