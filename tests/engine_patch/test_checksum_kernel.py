"""The arithmetic the fused CPU kernel compiles (``block_row_sums``) gives
the eager numpy pass's bits for every order of a row's dims, every span
count and member count, run eagerly in torch: no compile needed to see a
wrong formula (test_worker_compile.py runs the compiled kernel)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine_patch import checksum_kernel

ROW = {"parts": 2, "tokens": 8, "heads": 3, "pieces": 4}


@pytest.mark.parametrize("order", list(itertools.permutations(ROW)), ids="-".join)
@pytest.mark.parametrize(("spans", "members"), [(1, 1), (2, 3), (4, 2)])
def test_block_row_sums_equal_the_eager_pass(
    order: tuple[str, ...], spans: int, members: int
) -> None:
    rng = np.random.default_rng(len(order) * spans + members)
    num_blocks = 5
    dims = tuple(1 + order.index(name) for name in ROW)
    assert len(dims) == 4
    row_shape = tuple(ROW[name] for name in order)
    int64 = np.iinfo(np.int64)
    x = rng.integers(
        int64.min, int64.max, (num_blocks * members, *row_shape), np.int64, True
    )
    # Q(p): 1 but in the parts and pieces dims.
    piece_shape = tuple(
        ROW[name] if name in ("parts", "pieces") else 1 for name in order
    )
    piece_weights = rng.integers(int64.min, int64.max, piece_shape, np.int64, True)
    head_weights = rng.integers(
        int64.min, int64.max, (members, ROW["heads"]), np.int64, True
    )
    positions = rng.integers(int64.min, int64.max, (num_blocks, ROW["tokens"]))
    positions[-1, 5:] = 0  # the request ends in its last block
    want = checksum_kernel.host_row_sums_(
        x.copy(),
        np.empty_like(x),
        piece_weights,
        head_weights,
        positions,
        spans,
        (dims[0], dims[1], dims[2], dims[3]),
    )
    got = checksum_kernel.block_row_sums(
        torch.from_numpy(x).view(num_blocks, members, *row_shape),
        torch.from_numpy(piece_weights),
        torch.from_numpy(head_weights),
        torch.from_numpy(positions),
        spans,
        (dims[0], dims[1], dims[2], dims[3]),
    )
    assert got.shape == (num_blocks, spans)
    assert np.array_equal(got.numpy(), want)
