"""The arithmetic of checksum v1 (``docs/checksum.md``): ``mix`` and the
weighted sums of gathered rows, in torch (eager or fused by
``torch.compile``: accelerators) and in numpy (``host_*``: eager passes on
CPUs, where a call into torch costs several times one into numpy).

All give the same bits: every operation is on int64, which wraps modulo
2^64 like the definition's uint64 arithmetic, and a sum modulo 2^64 does not
depend on its order. The weight ``S(l, h) · A(t) · Q(p)`` is applied factor
by factor (``Q`` per piece, ``S`` per head, ``A`` per token), which the ring
allows.

A **row** is one block of one layer (or one state of a state layer), read as
int64 pieces ``[parts, tokens, heads, pieces]`` in any dim order: ``dims``
names where each of those four sits among a row's dims, so that a gather can
copy rows in their memory order. ``parts`` is 2 when K and V are separate
(piece ``p`` of V is the cell's piece ``P_K + p``), else 1.

Whether the fused kernel is used is decided in one place,
:func:`compile_default` (``KVGUARD_CHECKSUM_COMPILE``); where inductor keeps
its compiled code, by :func:`set_cache_dir` (``KVGUARD_CHECKSUM_CACHE_DIR``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from engine_patch.hashing import MIX_C1, MIX_C2
from engine_patch.log import get_logger

logger = get_logger(__name__)

# "1" turns the fused (torch.compile) kernel on, "0" off, where the caller
# leaves it open.
COMPILE_ENV = "KVGUARD_CHECKSUM_COMPILE"
# Where inductor keeps the fused kernel's code (else TORCHINDUCTOR_CACHE_DIR).
CACHE_DIR_ENV = "KVGUARD_CHECKSUM_CACHE_DIR"
# Logged (info) each time the fused kernel compiles, with the seconds it
# took: at a worker's warm-up, and never after it (a compile in an engine
# step stalls the engine).
COMPILED_FOR_A_SHAPE = "KVGuard's fused checksum kernel compiled for new shapes"


def _as_int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_C1 = _as_int64(MIX_C1)
_C2 = _as_int64(MIX_C2)
# torch's >> on int64 is arithmetic: masking the 31 bits a shift by 33 keeps
# makes it the logical shift fmix64 needs.
_LOW31 = (1 << 31) - 1
# numpy's uint64 has the logical shift, which AVX2 vectorizes (it has no
# 64-bit arithmetic shift): no mask, and about twice as fast on CPUs.
_NP_MULTIPLIERS = (np.uint64(MIX_C1), np.uint64(MIX_C2), None)
_NP_SHIFT = np.uint64(33)

# (source rows, row ids, piece weights, head weights, position weights,
# spans, dims) -> [rows, spans]
RowSums = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        int,
        tuple[int, int, int, int],
    ],
    torch.Tensor,
]


def compile_default(device: torch.device | None = None) -> bool:
    """Whether the fused kernel is used where the caller leaves it open:
    ``KVGUARD_CHECKSUM_COMPILE`` (``1``/``true``/``yes`` or
    ``0``/``false``/``no``) where set; else on for accelerators and off for
    CPUs (``device`` None: a CPU).

    On a CPU eager is the default because the fused kernel's one-off build
    (10-30 s per row shape) gains little on an engine's small passes. On a
    GPU the fused kernel reads large KV about 8x as fast as the eager chain
    of ops and small passes a little faster (an H100,
    ``benchmarks/gpu_check.sh``), and compiles in seconds at warm-up.
    """
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    return device is not None and device.type != "cpu"


_cache_dir: str | None = None


def set_cache_dir(path: str | None) -> None:
    """Keep the fused kernel's inductor code under ``path`` (e.g. beside the
    host engine's own compile cache) instead of ``KVGUARD_CHECKSUM_CACHE_DIR``
    or inductor's default; None goes back to those."""
    global _cache_dir
    _cache_dir = path


def cache_dir() -> str | None:
    """The directory the fused kernel compiles into, None for inductor's own
    (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    return _cache_dir or os.environ.get(CACHE_DIR_ENV) or None


@contextlib.contextmanager
def inductor_cache() -> Iterator[None]:
    """Point inductor (and Triton) at :func:`cache_dir` for one call, and
    back: the host's own compiles keep theirs."""
    path = cache_dir()
    if path is None or os.environ.get("TORCHINDUCTOR_CACHE_DIR") == path:
        yield
        return
    saved = {
        name: os.environ.get(name)
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    }
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def mix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 of every int64 of ``x`` (``hashing.mix``)."""
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _C1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _C2
    return x ^ ((x >> 33) & _LOW31)


def mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`mix` in place, with ``tmp`` (same shape) as scratch: no
    allocation, so eager chunks stay in cache. On a CPU it runs on numpy
    views of the same memory (the same bits)."""
    if x.device.type == "cpu":
        host_mix_(x.numpy(), tmp.numpy())
        return x
    for multiplier in (_C1, _C2, None):
        torch.bitwise_right_shift(x, 33, out=tmp)
        tmp &= _LOW31
        x ^= tmp
        if multiplier is not None:
            x *= multiplier
    return x


def host_mix_(x: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """:func:`mix` in place on int64 (or uint64) numpy arrays, ``tmp`` (same
    shape) as scratch."""
    xs, ts = x.view(np.uint64), tmp.view(np.uint64)
    for np_multiplier in _NP_MULTIPLIERS:
        np.right_shift(xs, _NP_SHIFT, out=ts)
        np.bitwise_xor(xs, ts, out=xs)
        if np_multiplier is not None:
            np.multiply(xs, np_multiplier, out=xs)
    return x


def host_row_sums_(
    x: np.ndarray,
    tmp: np.ndarray,
    piece_weights: np.ndarray,
    head_weights: np.ndarray,
    positions: np.ndarray,
    spans: int,
    dims: tuple[int, int, int, int],
) -> np.ndarray:
    """:func:`gathered_row_sums_` on numpy arrays in host memory (``x``
    overwritten, ``tmp`` scratch of its shape): the same int64 ring and the
    same bits.

    In an engine a pass runs with cold caches, and then each call into
    torch costs several times one into numpy; a pass of small requests is
    mostly such calls, so on CPUs the eager pass is all numpy.
    """
    host_mix_(x, tmp)
    # einsum's sums over axes run several times faster than ndarray.sum's
    # over short inner axes (same wrapping int64 sums), and weighing in the
    # same pass saves one over ``x``.
    per_cell = np.einsum(
        _weighted_cell_sums(dims), x, _parts_pieces(piece_weights, dims)
    )
    num_blocks, block_tokens = positions.shape
    members, num_heads = head_weights.shape
    per_cell = per_cell.reshape(num_blocks, members, block_tokens, num_heads)
    per_token = np.einsum("bmth,mh->bt", per_cell, head_weights)
    sums: np.ndarray = np.einsum(
        "bst,bst->bs",
        per_token.reshape(num_blocks, spans, -1),
        positions.reshape(num_blocks, spans, -1),
    )
    return sums


@functools.cache
def _weighted_cell_sums(dims: tuple[int, int, int, int]) -> str:
    """The einsum of rows' per-cell sums ``[rows, tokens, heads]`` weighed
    by ``[parts, pieces]`` (in their dims' order), for rows whose dims 1 to 4
    hold parts, tokens, heads and pieces at ``dims``."""
    axes = ["r", "", "", "", ""]
    for letter, dim in zip("pthq", dims, strict=True):
        axes[dim] = letter
    parts, _, _, pieces = dims
    return "".join(axes) + (",pq" if parts < pieces else ",qp") + "->rth"


def _parts_pieces(
    piece_weights: np.ndarray, dims: tuple[int, int, int, int]
) -> np.ndarray:
    """Piece weights shaped to broadcast over a row's dims 1 to 4 (1 but in
    its parts and pieces dims) as ``[parts, pieces]``, in their dims'
    order."""
    sizes = piece_weights.shape[-4:]
    parts, _, _, pieces = dims
    lo, hi = sorted((parts, pieces))
    return piece_weights.reshape(sizes[lo - 1], sizes[hi - 1])


def _block_sums(
    per_cell: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    transposed: bool,
) -> torch.Tensor:
    """Rows' per-cell sums ``[blocks * members, tokens, heads]`` (``heads,
    tokens`` if ``transposed``) to their blocks' span sums."""
    if transposed:
        per_cell = per_cell.transpose(1, 2)
    num_blocks, tokens = positions.shape
    members, heads = head_weights.shape
    per_cell = per_cell.reshape(num_blocks, members, tokens, heads)
    per_token = (per_cell * head_weights[:, None, :]).sum(dim=(1, 3))
    return (per_token * positions).view(num_blocks, spans, -1).sum(dim=2)


def row_sums(
    src: torch.Tensor,
    rows: torch.Tensor,
    piece_weights: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """Per block ``b`` and span ``s``: ``Σ positions[b, t] · head_weights[m,
    h] · piece_weights[part, p] · mix(x)`` over the rows ``rows[b * M + m]``
    of its ``M`` members, the span's tokens, the heads, parts and pieces
    (int64, wrapping): ``[blocks, spans]``, the tokens cut into ``spans``
    equal spans.

    Args:
        src: int64 pieces ``[num_rows, *row dims]``.
        rows: Row ids (int64), block-major: ``blocks * M``.
        piece_weights: ``Q(p)``, 1 in all but a row's parts and pieces dims.
        head_weights: ``S(l, h)`` per member and head: ``[M, heads]``.
        positions: ``A(t)`` per block and token, 0 past the request's
            tokens: ``[blocks, tokens]``.
        spans: Values per block.
        dims: Where parts, tokens, heads and pieces are among ``src``'s dims
            (1 to 4).

    """
    return gathered_row_sums(
        src[rows], piece_weights, head_weights, positions, spans, dims
    )


def gathered_row_sums(
    x: torch.Tensor,
    piece_weights: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """:func:`row_sums` of rows already gathered into ``x``, without
    overwriting it: the function ``torch.compile`` fuses for devices (a
    CPU's AOTInductor package runs :func:`block_row_sums`)."""
    parts, tokens, heads, pieces = dims
    per_cell = (mix(x) * piece_weights).sum(dim=(parts, pieces))
    return _block_sums(per_cell, head_weights, positions, spans, tokens > heads)


def block_row_sums(
    rows: torch.Tensor,
    piece_weights: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """:func:`gathered_row_sums` of rows given block by block (``[blocks,
    members, *row dims]``), weighed element by element and summed once per
    block and span: the form a CPU's fused loop runs fastest.

    Summing each cell's pieces first, as :func:`gathered_row_sums` does,
    makes inductor's CPU loop reduce a vector register to one value every 16
    pieces; one sum over a whole span accumulates in vector registers and
    reduces once (about 10x faster on AVX-512, and 5-7x faster than the
    eager numpy pass over 12 to 64 blocks).
    """
    _, tokens, heads, _ = dims
    num_blocks, members = rows.shape[:2]
    head_shape = [1] * rows.dim()
    head_shape[1], head_shape[1 + heads] = members, head_weights.shape[1]
    position_shape = [1] * rows.dim()
    position_shape[0], position_shape[1 + tokens] = num_blocks, positions.shape[1]
    weighted = (
        mix(rows)
        * piece_weights
        * head_weights.reshape(head_shape)
        * positions.reshape(position_shape)
    )
    by_span = list(weighted.shape)
    by_span[1 + tokens : 2 + tokens] = [spans, by_span[1 + tokens] // spans]
    summed = [dim for dim in range(1, len(by_span)) if dim != 1 + tokens]
    return weighted.reshape(by_span).sum(dim=summed)


def gathered_row_sums_(
    x: torch.Tensor,
    tmp: torch.Tensor,
    piece_weights: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """:func:`row_sums` of rows already gathered into ``x`` (owned by the
    caller: overwritten), with in-place eager ops over the big tensor;
    ``tmp`` is scratch of ``x``'s shape."""
    mix_(x, tmp)
    x *= piece_weights
    parts, tokens, heads, pieces = dims
    # One dim at a time, the later first: about twice as fast on a CPU as
    # both at once (the same sums).
    per_cell = x.sum(dim=max(parts, pieces)).sum(dim=min(parts, pieces))
    return _block_sums(per_cell, head_weights, positions, spans, tokens > heads)


def cpu_options() -> dict[str, str | int | bool | Callable[..., Any]]:
    """Inductor options for CPUs: without AVX-512 (no 64-bit vector
    multiply) inductor's vectorized loops emulate int64 products element by
    element and run about 3x slower than plain scalar loops, so vectorizing
    is turned off there."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return {}
    return {"cpp.simdlen": 1}


_compiled: RowSums | None = None
_compile_failed = False
_compile_lock = threading.Lock()


def compiled_row_sums() -> RowSums | None:
    """:func:`row_sums` under ``torch.compile`` (one fused pass over the
    gathered rows), compiled on first use into :func:`cache_dir`; None once
    compiling failed.

    Shapes are dynamic, so chunks of any length and sources of any shape
    share compiled code (a new dim order or dtype compiles once more, and a
    pass of one block once: torch specializes a dim of size 1).
    """
    global _compiled
    with _compile_lock:
        if _compiled is None and not _compile_failed:
            # Imported here: eager passes need neither.
            import torch.fx.experimental._config as shape_config
            from torch._dynamo.utils import counters as dynamo_counters

            kernel = torch.compile(row_sums, dynamic=True, options=cpu_options())

            def call(*args):  # type: ignore[no-untyped-def]
                # Without duck shapes: dynamo would otherwise take dims that
                # happen to be equal when it compiles (two blocks, two
                # heads) for one symbol, and compile again, for seconds
                # (tens without a warm cache) inside an engine step, for
                # every other block count.
                # (``patch`` is installed at import: typed for no checker.)
                no_duck_shapes = shape_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]
                graphs = dynamo_counters["stats"]["unique_graphs"]
                start = time.perf_counter()
                with inductor_cache(), no_duck_shapes:
                    sums = kernel(*args)
                if dynamo_counters["stats"]["unique_graphs"] != graphs:
                    count_compile(time.perf_counter() - start)
                return sums

            _compiled = call
        return None if _compile_failed else _compiled


_compiles = 0


def count_compile(seconds: float) -> None:
    """Log and count a compile of a fused kernel for new shapes."""
    global _compiles
    _compiles += 1
    logger.info("%s in %.1f s.", COMPILED_FOR_A_SHAPE, seconds)


def compiles() -> int:
    """Fused kernels compiled in this process so far."""
    return _compiles


def can_compile() -> bool:
    """Whether fused kernels may still be used: no compile failed."""
    return not _compile_failed


def compile_failed(error: BaseException) -> None:
    """Fall back to eager kernels for good after a failed compile."""
    global _compile_failed
    with _compile_lock:
        if not _compile_failed:
            # With its traceback: the error alone rarely says which of
            # export, inductor or the C++ build failed.
            logger.warning(
                "torch.compile of the KV checksum kernel failed; using eager "
                "kernels (same values, slower): %s",
                error,
                exc_info=error,
            )
        _compile_failed = True
