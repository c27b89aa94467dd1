"""Fault injection into KV transfers: which transfers a fault strikes, and
what it does to the KV they carry.

KV in transit is a tensor ``[tokens, layers, heads, 2, head_size]`` whose
tokens are whole blocks of the side's block size. Corruptions strike the
prompt's tokens before its last one: a consumer recomputes the last prompt
token's KV itself (as vLLM does after a full load), so corruption there is
never used.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine_patch.kv_cache import cdiv
from engine_patch.log import get_logger
from fake_engine.config import FaultConfig, FaultKind, FaultSide

logger = get_logger(__name__)

# KV of ``count`` tokens of an earlier request: [count, layers, heads, 2, head_size].
StaleSource = Callable[[int], torch.Tensor]


class Fault(NamedTuple):
    """A fault striking one transfer; ``seed`` fixes what it corrupts."""

    kind: FaultKind
    seed: int = 0


NO_FAULT = Fault(FaultKind.NONE)


class FaultInjector:
    """Decides which transfers a fault strikes: on ``rate`` of them, for the
    next ``count``; seeded, so a run repeats."""

    def __init__(self, config: FaultConfig, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self.injected: Counter[tuple[str, str]] = Counter()
        self._config = config
        self._remaining = config.count

    @property
    def config(self) -> FaultConfig:
        return self._config

    @property
    def remaining(self) -> int | None:
        """Transfers the fault still strikes (None: no limit)."""
        return self._remaining

    def configure(self, config: FaultConfig) -> None:
        """Replace the fault (and restart its count)."""
        self._config = config
        self._remaining = config.count

    def draw(self, side: FaultSide) -> Fault:
        """The fault striking the next transfer on ``side``, or NO_FAULT."""
        config = self._config
        if config.fault is FaultKind.NONE or config.side is not side:
            return NO_FAULT
        if self._remaining == 0:
            return NO_FAULT
        if config.rate < 1.0 and self._rng.random() >= config.rate:
            return NO_FAULT
        if self._remaining is not None:
            self._remaining -= 1
        self.injected[(config.fault.value, side.value)] += 1
        return Fault(config.fault, self._rng.getrandbits(64))

    @staticmethod
    def corrupt(
        fault: Fault,
        kv: torch.Tensor,
        num_tokens: int,
        block_size: int,
        stale: StaleSource,
    ) -> str:
        """Corrupt ``kv`` (in place) as ``fault`` does; returns what it did.

        Args:
            fault: A fault whose kind corrupts.
            kv: KV in transit, whole blocks of ``block_size`` tokens.
            num_tokens: Tokens of the request the blocks hold.
            block_size: The side's block size (blocks are its unit).
            stale: Gives KV of an earlier request.

        """
        rng = random.Random(fault.seed)
        return _CORRUPTIONS[fault.kind](rng, kv, num_tokens, block_size, stale)


def _used_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks holding prompt tokens before the last one (at least one)."""
    return max(1, cdiv(max(1, num_tokens - 1), block_size))


def _bitflip(
    rng: random.Random,
    kv: torch.Tensor,
    num_tokens: int,
    block_size: int,
    _: StaleSource,
) -> str:
    token = rng.randrange(max(1, num_tokens - 1))
    layer = rng.randrange(kv.shape[1])
    head = rng.randrange(kv.shape[2])
    half = rng.randrange(2)
    cell = kv[token, layer, head, half].view(torch.uint8)
    byte = rng.randrange(cell.numel())
    bit = rng.randrange(8)
    cell[byte] ^= 1 << bit
    return (
        f"flipped bit {bit} of byte {byte} of token {token} layer {layer} head {head}"
    )


def _zero(
    rng: random.Random,
    kv: torch.Tensor,
    num_tokens: int,
    block_size: int,
    _: StaleSource,
) -> str:
    block = rng.randrange(_used_blocks(num_tokens, block_size))
    kv[block * block_size : (block + 1) * block_size] = 0
    return f"zeroed block {block}"


def _swap(
    rng: random.Random,
    kv: torch.Tensor,
    num_tokens: int,
    block_size: int,
    stale: StaleSource,
) -> str:
    num_blocks = cdiv(num_tokens, block_size)
    if num_blocks < 2:
        if num_tokens < 3:
            return _bitflip(rng, kv, num_tokens, block_size, stale)
        kv[[0, 1]] = kv[[1, 0]]
        return "swapped tokens 0 and 1"
    first = rng.randrange(_used_blocks(num_tokens, block_size))
    second = rng.choice([b for b in range(num_blocks) if b != first])
    a = slice(first * block_size, (first + 1) * block_size)
    b = slice(second * block_size, (second + 1) * block_size)
    kv[a], kv[b] = kv[b].clone(), kv[a].clone()
    return f"swapped blocks {first} and {second}"


def _stale(
    rng: random.Random,
    kv: torch.Tensor,
    num_tokens: int,
    block_size: int,
    stale: StaleSource,
) -> str:
    block = rng.randrange(_used_blocks(num_tokens, block_size))
    kv[block * block_size : (block + 1) * block_size] = stale(block_size)
    return f"replaced block {block} with a block of an earlier request"


def _truncate(
    rng: random.Random,
    kv: torch.Tensor,
    num_tokens: int,
    block_size: int,
    _: StaleSource,
) -> str:
    # The last block the consumer uses: the request's last block may hold
    # only its last prompt token, which the consumer recomputes.
    last = _used_blocks(num_tokens, block_size) - 1
    start = last * block_size
    used = min(max(1, num_tokens - 1), start + block_size)
    cut = start + (used - start) // 2
    kv[cut : start + block_size] = 0
    return f"truncated block {last} after {cut - start} tokens"


def _shift(
    rng: random.Random,
    kv: torch.Tensor,
    num_tokens: int,
    block_size: int,
    stale: StaleSource,
) -> str:
    num_blocks = cdiv(num_tokens, block_size)
    unit = block_size if num_blocks > 1 else 1
    if num_blocks == 1 and num_tokens < 3:
        return _bitflip(rng, kv, num_tokens, block_size, stale)
    end = num_blocks * block_size if num_blocks > 1 else num_tokens
    kv[: end - unit] = kv[unit:end].clone()
    kv[end - unit : end] = 0
    return f"shifted KV by one {'block' if unit > 1 else 'token'}"


_CORRUPTIONS = {
    FaultKind.BITFLIP: _bitflip,
    FaultKind.ZERO: _zero,
    FaultKind.SWAP: _swap,
    FaultKind.STALE: _stale,
    FaultKind.TRUNCATE: _truncate,
    FaultKind.SHIFT: _shift,
}
