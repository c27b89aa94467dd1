"""The arithmetic of checksum v1 (``checksum.md``) in torch: ``mix`` and the
weighted sums of blocks, eager or fused by ``torch.compile``.

Both give the same bits: every operation is on int64, which wraps modulo
2^64 like the definition's uint64 arithmetic, and a sum modulo 2^64 does not
depend on its order.

A block's data arrives in the canonical shape ``[blocks, parts, tokens,
heads, pieces]`` of int64 pieces: ``parts`` is 2 when K and V are separate
(piece ``p`` of V is the cell's piece ``P_K + p``), else 1.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable

import torch

from engine_patch.hashing import MIX_C1, MIX_C2

logger = logging.getLogger(__name__)

# "1" turns the fused (torch.compile) kernel on where the caller leaves it open.
COMPILE_ENV = "KVGUARD_CHECKSUM_COMPILE"


def _as_int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_C1 = _as_int64(MIX_C1)
_C2 = _as_int64(MIX_C2)
# torch's >> on int64 is arithmetic: masking the 31 bits a shift by 33 keeps
# makes it the logical shift fmix64 needs.
_LOW31 = (1 << 31) - 1

BlockSums = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def compile_default() -> bool:
    """Whether ``KVGUARD_CHECKSUM_COMPILE`` asks for the fused kernel."""
    return os.environ.get(COMPILE_ENV, "").strip().lower() in ("1", "true", "yes")


def mix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 of every int64 of ``x`` (``hashing.mix``)."""
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _C1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _C2
    return x ^ ((x >> 33) & _LOW31)


def mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`mix` in place, with ``tmp`` (same shape) as scratch: no
    allocation, so eager chunks stay in cache."""
    for multiplier in (_C1, _C2, None):
        torch.bitwise_right_shift(x, 33, out=tmp)
        tmp &= _LOW31
        x ^= tmp
        if multiplier is not None:
            x *= multiplier
    return x


def block_sums(
    src: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Per block ``ids[i]`` and span ``s`` of ``src``, ``Σ positions[i, s, t]
    · weights[part, h, p] · mix(x)`` over the span's tokens and their parts,
    heads and pieces (int64, wrapping): ``[len(ids), spans]``.

    Args:
        src: Canonical int64 pieces ``[blocks, parts, tokens, heads, pieces]``.
        ids: Block ids (int64) to sum.
        weights: ``S(l, h) · Q(p)`` shaped ``[parts, 1, heads, pieces]``.
        positions: ``A(t)`` per block, span and token of the span, 0 past
            the request's tokens: ``[len(ids), spans, tokens // spans]``.

    """
    mixed = mix(src[ids]) * weights
    per_token = mixed.sum(dim=(1, 3, 4))
    return (per_token.view(positions.shape) * positions).sum(dim=2)


def gathered_sums_(
    x: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    tmp: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`block_sums` of blocks already gathered into ``x`` (canonical,
    contiguous, owned by the caller: it is overwritten), with in-place eager
    ops; ``tmp`` is scratch of ``x``'s shape (allocated if None)."""
    mix_(x, torch.empty_like(x) if tmp is None else tmp)
    x *= weights
    per_token = x.sum(dim=(1, 3, 4)).view(positions.shape)
    per_token *= positions
    return per_token.sum(dim=2)


def block_sums_eager(
    src: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`block_sums` with eager ops, gathering into ``scratch`` (1-D
    int64, two gathered chunks' worth) when it is large enough, so that
    nothing is allocated per chunk."""
    shape = (ids.numel(), *src.shape[1:])
    numel = math.prod(shape)
    if scratch is not None and scratch.numel() >= 2 * numel:
        x = torch.index_select(src, 0, ids, out=scratch[:numel].view(shape))
        return gathered_sums_(
            x, weights, positions, scratch[numel : 2 * numel].view(shape)
        )
    return gathered_sums_(src.index_select(0, ids), weights, positions)


_compiled: BlockSums | None = None
_compile_failed = False
_compile_lock = threading.Lock()


def compiled_block_sums() -> BlockSums | None:
    """:func:`block_sums` under ``torch.compile`` (one fused pass over the
    data), compiled on first use; None once compiling failed.

    Shapes are dynamic, so chunks of any length and layers of any shape
    share one compiled kernel. Inductor caches its code on disk
    (``TORCHINDUCTOR_CACHE_DIR``), so a later process starts in seconds.
    """
    global _compiled
    with _compile_lock:
        if _compiled is None and not _compile_failed:
            _compiled = torch.compile(block_sums, dynamic=True)
        return None if _compile_failed else _compiled


def compile_failed(error: BaseException) -> None:
    """Fall back to eager kernels for good after a failed compile."""
    global _compile_failed
    with _compile_lock:
        if not _compile_failed:
            logger.warning(
                "torch.compile of the KV checksum kernel failed; using eager "
                "kernels (same values, slower): %s",
                error,
            )
        _compile_failed = True
