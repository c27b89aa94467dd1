"""The fused checksum kernel for host passes, compiled ahead of time by
AOTInductor and kept on disk.

On a CPU, ``torch.compile``'s kernel spends about two thirds of a small
pass in dynamo's and AOT autograd's per-call wrappers; an AOTInductor
package runs the same fused loop behind a C++ runner that costs a few
microseconds a call. Each package is built for one row shape, member count
and span count, with the number of blocks dynamic: a worker needs one or
two. A package is keyed by torch's version, the CPU's vector ISA and the
kernel's source, so a build is reused by every later process on the
machine (loading one takes well under a second) and never one built from
other code.

Every kernel is checked against the eager numpy pass on random rows before
its first use; one that differs is never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_patch import checksum_kernel, hashing
from engine_patch.log import get_logger

logger = get_logger(__name__)

# Logged (info) when a package is loaded from disk, with the seconds it took.
LOADED_FOR_A_SHAPE = "KVGuard's fused checksum kernel loaded for new shapes"

# (row shape without the row dim, dims, spans, piece weights' shape, head
# weights' shape ([members, heads]), tokens per block)
KernelKey = tuple[
    tuple[int, ...],
    tuple[int, int, int, int],
    int,
    tuple[int, ...],
    tuple[int, ...],
    int,
]


class HostKernel:
    """One AOTInductor package's runner: span sums of gathered rows, the bits
    of :func:`checksum_kernel.host_row_sums_`."""

    def __init__(self, key: KernelKey, runner: Any) -> None:
        self._row_shape = key[0]
        self._members = key[4][0]
        self._runner = runner

    def __call__(
        self,
        x: np.ndarray,
        piece_weights: torch.Tensor,
        head_weights: torch.Tensor,
        positions: np.ndarray,
    ) -> np.ndarray:
        """``[blocks, spans]`` sums of ``x`` (``[blocks * members, *row
        shape]`` int64 pieces, block-major), as
        :func:`checksum_kernel.host_row_sums_` computes them (without
        overwriting ``x``). The weights come as the CPU tensors a worker
        keeps: in an engine's cold caches each conversion from numpy costs
        about 5 µs, a tenth of a small pass's kernel.

        Raises:
            ValueError: If ``x`` is not C-contiguous (the kernel reads it as
                such).
        """
        if not x.flags.c_contiguous:
            raise ValueError("the fused kernel reads C-contiguous rows")
        num_blocks = positions.shape[0]
        rows = torch.from_numpy(x).view(num_blocks, self._members, *self._row_shape)
        (sums,) = self._runner.run(
            [
                rows,
                piece_weights,
                head_weights,
                torch.from_numpy(positions),
            ]
        )
        result: np.ndarray = sums.numpy()
        return result


class _RowSums(torch.nn.Module):
    """:func:`checksum_kernel.block_row_sums` of rows given block by block
    (``[blocks, members, *row shape]``), the module AOTInductor compiles."""

    def __init__(self, dims: tuple[int, int, int, int], spans: int) -> None:
        super().__init__()
        self.dims = dims
        self.spans = spans

    def forward(
        self,
        rows: torch.Tensor,
        piece_weights: torch.Tensor,
        head_weights: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        return checksum_kernel.block_row_sums(
            rows,
            piece_weights,
            head_weights,
            positions,
            self.spans,
            self.dims,
        )


_kernels: dict[KernelKey, HostKernel] = {}
_lock = threading.Lock()
_loads = 0


def loads() -> int:
    """Packages loaded from disk in this process so far (builds are counted
    by :func:`checksum_kernel.compiles`)."""
    return _loads


def host_kernel(
    row_shape: tuple[int, ...],
    dims: tuple[int, int, int, int],
    spans: int,
    piece_weights: np.ndarray,
    head_weights: np.ndarray,
    tokens: int,
) -> HostKernel | None:
    """The fused kernel for rows of ``row_shape`` read ``len(head_weights)``
    per block, ``tokens`` positions per block, loaded or built on first use
    (under a second to load, about 10-30 s to build on a CPU); None once
    compiling failed (eager passes from then on). ``piece_weights`` and
    ``head_weights`` are the ones it will be called with: its check against
    the eager pass uses them."""
    key: KernelKey = (
        tuple(row_shape),
        dims,
        spans,
        piece_weights.shape,
        head_weights.shape,
        tokens,
    )
    # After any failure, eager for good: a kernel prepared before it too.
    if not checksum_kernel.can_compile():
        return None
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get(key)
        if kernel is None and checksum_kernel.can_compile():
            try:
                kernel = _prepare(key, piece_weights, head_weights)
            except Exception as e:  # Export and inductor raise many kinds.
                checksum_kernel.compile_failed(e)
                return None
            _kernels[key] = kernel
    return kernel


def _prepare(
    key: KernelKey, piece_weights: np.ndarray, head_weights: np.ndarray
) -> HostKernel:
    """Load the key's package, or build it; checked against the eager pass.

    Raises:
        RuntimeError: If the kernel's sums differ from the eager pass's.
    """
    global _loads
    path = package_path(key)
    start = time.perf_counter()
    kernel = None
    # Workers starting together (TP ranks, engines on one machine) build a
    # package once: the others wait, then load it.
    with _locked(path):
        if path.exists():
            try:
                kernel = HostKernel(key, _load(path))
                _loads += 1
                logger.info(
                    "%s from %s in %.1f s.",
                    LOADED_FOR_A_SHAPE,
                    path,
                    time.perf_counter() - start,
                )
            except Exception as e:  # A damaged or foreign file: built again.
                logger.warning("Cannot load %s (%s); building it again.", path, e)
        if kernel is None:
            # A build takes seconds, minutes on a loaded machine: say so first.
            logger.info("Building KVGuard's fused checksum kernel into %s.", path)
            _build(key, path)
            kernel = HostKernel(key, _load(path))
            checksum_kernel.count_compile(time.perf_counter() - start)
    _check(kernel, key, piece_weights, head_weights)
    return kernel


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file, across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process's build of %s.", path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(path: Path) -> Any:
    """The runner of the package at ``path``."""
    # Packages built without vector code record no vector ISA, which torch
    # warns of on every load; the ISA is in the package's name instead.
    package_logger = logging.getLogger("torch.export.pt2_archive._package")
    level = package_logger.level
    package_logger.setLevel(logging.ERROR)
    try:
        return torch._inductor.aoti_load_package(str(path)).loader
    finally:
        package_logger.setLevel(level)


def _build(key: KernelKey, path: Path) -> None:
    """Export the kernel for ``key`` and compile it into the package at
    ``path`` (written whole or not at all)."""
    row_shape, dims, spans, piece_shape, head_shape, tokens = key
    blocks = torch.export.Dim("blocks", min=1, max=1 << 30)
    example = (
        torch.zeros((2, head_shape[0], *row_shape), dtype=torch.int64),
        torch.ones(piece_shape, dtype=torch.int64),
        torch.ones(head_shape, dtype=torch.int64),
        torch.ones((2, tokens), dtype=torch.int64),
    )
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
    os.close(fd)
    try:
        with (
            torch.no_grad(),
            warnings.catch_warnings(),
            checksum_kernel.inductor_cache(),
        ):
            # torch's own pytree code warns of its deprecated API here.
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(
                _RowSums(dims, spans),
                example,
                dynamic_shapes=({0: blocks}, None, None, {0: blocks}),
            )
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=tmp,
                # One thread: the engine's forward has the cores.
                inductor_configs={**checksum_kernel.cpu_options(), "cpp.threads": 1},
            )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check(
    kernel: HostKernel,
    key: KernelKey,
    piece_weights: np.ndarray,
    head_weights: np.ndarray,
) -> None:
    """Compare the kernel with the eager numpy pass on random rows.

    Raises:
        RuntimeError: If they differ.
    """
    row_shape, dims, spans, _, head_shape, tokens = key
    rng = np.random.default_rng(0)
    num_blocks = 3
    x = rng.integers(
        np.iinfo(np.int64).min,
        np.iinfo(np.int64).max,
        (num_blocks * head_shape[0], *row_shape),
        dtype=np.int64,
        endpoint=True,
    )
    positions = rng.integers(1, 1 << 62, (num_blocks, tokens), dtype=np.int64) | 1
    positions[-1, tokens // 2 :] = 0
    got = kernel(
        x, torch.from_numpy(piece_weights), torch.from_numpy(head_weights), positions
    )
    want = checksum_kernel.host_row_sums_(
        x.copy(), np.empty_like(x), piece_weights, head_weights, positions, spans, dims
    )
    if not np.array_equal(got, want):
        raise RuntimeError(f"the fused kernel for {key} differs from the eager pass")


def package_path(key: KernelKey) -> Path:
    """Where the package for ``key`` is kept: under
    :func:`checksum_kernel.cache_dir` (else inductor's cache), named by a
    hash of the key, torch's version, the CPU's vector ISA and the kernel's
    source."""
    identity = repr(
        (
            key,
            torch.__version__,
            torch.backends.cpu.get_cpu_capability(),
            _source_digest(),
        )
    )
    name = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return _package_dir() / f"row_sums-{name}.pt2"


def _package_dir() -> Path:
    root = checksum_kernel.cache_dir()
    if root is None:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        root = cache_dir()
    return Path(root) / "kvguard_aot"


@functools.cache
def _source_digest() -> str:
    """A hash of the code a package is built from."""
    digest = hashlib.sha256()
    for module in (checksum_kernel.__file__, hashing.__file__, __file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()
