"""Keeping a fail-open request's KV out of vLLM's prefix cache.

A fail-open request whose load mismatched its checksums decodes from the KV
it loaded, but no other request may ever reuse that KV, nor the KV the
request computes from it. vLLM 0.32 caches a request's full blocks under
the hashes in ``request.block_hashes``, each chained from the one before
(``kv_cache_utils.get_request_block_hasher``): first when its load has
finished (``Scheduler._update_waiting_for_remote_kv``, in the step after
the one that reports the load, hence after KVGuard's verdict), then as it
computes more.

:func:`keep_out_of_prefix_cache` gives every block from the first loaded
one on a random hash instead, before that first caching: such blocks are
cached under keys no prompt hashes to, so no other request's lookup finds
them (nor an offloading connector's, which keys KV by the same hashes),
and they leave the cache as vLLM evicts any free block. Blocks before the
load (the request's own local prefix hits) keep theirs.

:func:`keep_blocks_out_of_prefix_cache` does the same for chosen blocks of a
verified load only: a sliding-window load's first kept blocks can hold
tokens its producer never sent (outside the request's window, so the request
never reads them; another request's window could).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import BlockHash

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _unreachable(block_hash: BlockHash) -> BlockHash:
    """A random hash of the same size: no prompt hashes to it."""
    return BlockHash(os.urandom(len(block_hash)))


def keep_out_of_prefix_cache(
    request: Request, first_loaded_token: int, hash_block_size: int
) -> None:
    """Give the request's blocks from the one holding ``first_loaded_token``
    on, those hashed already and those hashed as it decodes, random hashes.

    Must run before vLLM caches the loaded blocks: blocks cached already
    keep their keys.
    """
    first = first_loaded_token // hash_block_size
    hashes = request.block_hashes
    for i in range(first, len(hashes)):
        hashes[i] = _unreachable(hashes[i])
    # Blocks hashed later chain from a random parent, except the first
    # loaded one if it is not full yet (a load inside one block): the
    # request's hasher, which vLLM takes only at construction, is wrapped.
    hasher: Callable[[Request], list[BlockHash]] | None = request._block_hasher
    if hasher is None:
        return

    def hash_new_blocks(req: Request) -> list[BlockHash]:
        start = len(req.block_hashes)
        return [
            _unreachable(h) if start + i >= first else h
            for i, h in enumerate(hasher(req))
        ]

    request._block_hasher = hash_new_blocks


def keep_blocks_out_of_prefix_cache(
    request: Request, token_ranges: Iterable[tuple[int, int]], hash_block_size: int
) -> None:
    """Give the request's hashed blocks holding any token of ``token_ranges``
    (each ``[start, end)``) random hashes; the others keep theirs.

    Blocks hashed already keep their hashes, chained from the real ones, so
    a lookup of the same prompt still finds those after a replaced one (a
    sliding-window lookup needs only its window's blocks). A block hashed
    later chains from the request's last hash, and is unreachable too if
    that one was replaced: a lost cache hit, never a wrong one. Must run
    before vLLM caches the loaded blocks.
    """
    hashes = request.block_hashes
    for start, end in token_ranges:
        for i in range(
            start // hash_block_size, min(cdiv(end, hash_block_size), len(hashes))
        ):
            hashes[i] = _unreachable(hashes[i])
