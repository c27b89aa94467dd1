"""``engine_patch.verify.chunk_sums``: sums of consecutive blocks' checksums
over larger chunks, as a plain reference pads and sums them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_host_fakes import (
    block_sums,
    token_values,
)
from scheduler_harness import (
    RNG,
)

from engine_patch.verify import (
    chunk_sums,
)


def test_chunk_sums_of_small_blocks_equal_the_large_blocks() -> None:
    tokens = token_values(RNG, 70)
    small = block_sums(tokens, 16, 0, 5, 70)
    first, sums = chunk_sums(small, 0, 16, 32, 70)
    assert first == 0
    np.testing.assert_array_equal(sums, block_sums(tokens, 32, 0, 3, 70))


def test_chunk_sums_leave_out_chunks_not_covered_whole() -> None:
    values = np.arange(1, 6, dtype=np.uint64)
    # Blocks 1..5 of 16 tokens of a 200-token request, chunks of 32: block 1
    # is half of chunk 0 and block 5 half of chunk 2; chunks 1..2 are whole.
    first, sums = chunk_sums(values, 1, 16, 32, 200)
    assert first == 1
    assert sums.tolist() == [2 + 3, 4 + 5]


def test_chunk_sums_with_a_huge_block_size_do_not_allocate_it() -> None:
    first, sums = chunk_sums(np.ones(3, dtype=np.uint64), 0, 16, 16 << 40, 40)
    assert (first, sums.tolist()) == (0, [3])


def _reference_chunk_sums(
    values: np.ndarray, start: int, block_size: int, chunk_size: int, num_tokens: int
) -> tuple[int, np.ndarray]:
    """A plain reference of chunk sums: it pads the last chunk with zero blocks."""
    blocks_per_chunk = chunk_size // block_size
    end = start + len(values)
    if end >= -(-num_tokens // block_size):
        values = np.pad(values, (0, -end % blocks_per_chunk))
        end += -end % blocks_per_chunk
    first = -(-start // blocks_per_chunk)
    last = max(first, end // blocks_per_chunk)
    whole = values[first * blocks_per_chunk - start : last * blocks_per_chunk - start]
    return first, whole.reshape(-1, blocks_per_chunk).sum(axis=1, dtype=np.uint64)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=12),
    st.integers(0, 10),
    st.sampled_from([1, 2, 16]),
    st.integers(1, 4),
    st.integers(0, 400),
)
def test_chunk_sums_equal_the_specs_padded_sums(
    values: list[int],
    start: int,
    block_size: int,
    blocks_per_chunk: int,
    num_tokens: int,
) -> None:
    array = np.array(values, dtype=np.uint64)
    chunk_size = block_size * blocks_per_chunk
    first, sums = chunk_sums(array, start, block_size, chunk_size, num_tokens)
    want_first, want = _reference_chunk_sums(
        array, start, block_size, chunk_size, num_tokens
    )
    if len(want):
        assert first == want_first
    assert sums.tolist() == want.tolist()
