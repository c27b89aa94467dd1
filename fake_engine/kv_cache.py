"""The fake engine's paged KV cache bookkeeping: a pool of fixed-size blocks
and each request's block table (vLLM's ``BlockPool`` and
``KVCacheManager``, one KV cache group)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine_patch.kv_cache import cdiv


@dataclass(frozen=True)
class KVBlock:
    """One block of the cache (``engine_patch.host.Block``)."""

    block_id: int
    is_null: bool = False


@dataclass
class RequestBlocks:
    """A request's blocks per KV cache group (``engine_patch.host.KVCacheBlocks``)."""

    blocks: list[list[KVBlock]]


class BlockPool:
    """Fixed-size blocks handed out first-freed-first-reused, as vLLM's free
    queue does, so a freed block keeps its content for a while. Block 0 is
    the null block and never handed out."""

    def __init__(self, num_blocks: int) -> None:
        self.null_block = KVBlock(0, is_null=True)
        self._blocks = [self.null_block] + [KVBlock(i) for i in range(1, num_blocks)]
        self._free: deque[KVBlock] = deque(self._blocks[1:])
        # Blocks that held a request's KV, most recently freed last.
        self._used_free: deque[int] = deque(maxlen=64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return len(self._blocks) - 1

    def allocate(self, count: int) -> list[KVBlock] | None:
        """``count`` free blocks, or None if there are not that many."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def free(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            self._free.append(block)
            self._used_free.append(block.block_id)

    def recently_freed(self, exclude: set[int]) -> int | None:
        """The most recently freed block that still holds an earlier
        request's KV and is not in ``exclude``, if any."""
        free_ids = {block.block_id for block in self._free}
        for block_id in reversed(self._used_free):
            if block_id in free_ids and block_id not in exclude:
                return block_id
        return None


class KVCacheManager:
    """Each request's block table (``engine_patch.host.KVCacheManager``)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[KVBlock]] = {}

    def get_blocks(self, request_id: str) -> RequestBlocks:
        return RequestBlocks([list(self._tables.get(request_id, ()))])

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def num_blocks(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; False (and
        nothing allocated) if the pool has too few free blocks."""
        table = self._tables.setdefault(request_id, [])
        needed = cdiv(num_tokens, self.block_size) - len(table)
        if needed <= 0:
            return True
        blocks = self.pool.allocate(needed)
        if blocks is None:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(blocks)
        return True

    def free(self, request_id: str) -> int:
        """Return the request's blocks to the pool; how many there were."""
        table = self._tables.pop(request_id, [])
        self.pool.free(table)
        return len(table)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Cache slots (``block_id * block_size + offset``) of the request's
        tokens ``[start, end)``."""
        return token_slots(self.block_ids(request_id), self.block_size, start, end)


def token_slots(
    block_ids: list[int], block_size: int, start: int, end: int
) -> torch.Tensor:
    """Cache slots of tokens ``[start, end)`` of a block table."""
    positions = torch.arange(start, end, dtype=torch.int64)
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size
