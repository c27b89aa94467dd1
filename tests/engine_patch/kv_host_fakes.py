"""Small host objects the checksum scheduler takes (request, blocks, connector,
connector output) and a stand-in for its workers' reports, for tests that do
not need torch."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np

from engine_patch.host import CacheHitSource, FinishReason
from engine_patch.kv_cache import KVCacheConfig, checksum_spans
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    num_valid_tokens,
)


@dataclass(frozen=True)
class FakeBlock:
    block_id: int
    is_null: bool = False


NULL_BLOCK = FakeBlock(0, is_null=True)


@dataclass
class FakeBlocks:
    blocks: list[list[FakeBlock]]

    @classmethod
    def of(cls, *groups: Sequence[int | None]) -> Self:
        """Blocks per group from their ids; None is the null block."""
        return cls(
            [
                [NULL_BLOCK if b is None else FakeBlock(b) for b in group]
                for group in groups
            ]
        )


@dataclass
class FakeKVCacheManager:
    by_request: dict[str, FakeBlocks] = field(default_factory=dict)

    def get_blocks(self, request_id: str) -> FakeBlocks:
        return self.by_request[request_id]


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: int | None = None

    def get_finished_reason(self) -> int | None:
        return self.finish_reason


def producer_request(req_id: str, num_prompt_tokens: int) -> FakeRequest:
    return FakeRequest(
        req_id, {"do_remote_decode": True}, num_prompt_tokens=num_prompt_tokens
    )


def consumer_request(
    req_id: str, num_prompt_tokens: int, params: Mapping[str, Any] | None = None
) -> FakeRequest:
    return FakeRequest(
        req_id,
        {"do_remote_prefill": True, **(params or {})},
        num_prompt_tokens=num_prompt_tokens,
    )


@dataclass
class FakeConnector:
    """Loads from ``sources``; offloads checksums for ``checksum_sources``;
    records the failures it hears of."""

    sources: dict[CacheHitSource, int] = field(
        default_factory=lambda: {CacheHitSource.P2P: 1}
    )
    checksum_sources: frozenset[CacheHitSource] = frozenset()
    failures: list[tuple[str, dict[int, list[int]]]] = field(default_factory=list)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> Mapping[CacheHitSource, int]:
        return self.sources if num_external_tokens else {}

    def get_kv_checksum_sources(self, request: Any) -> frozenset[CacheHitSource]:
        return self.checksum_sources

    def on_kv_checksum_failure(
        self, request: Any, mismatches: dict[int, list[int]]
    ) -> None:
        self.failures.append((request.request_id, mismatches))


@dataclass
class FakeConnectorOutput:
    kv_checksums: list[KVChecksumRecord] | None = None
    finished_recving: set[str] | None = None


FINISHED = FinishReason.STOP


def token_values(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    """Random per-token checksum terms: a block's checksum is the sum of its
    valid tokens' terms, which is all the scheduler relies on."""
    return rng.integers(0, 2**64, size=num_tokens, dtype=np.uint64)


def block_sums(
    tokens: np.ndarray, block_size: int, start: int, count: int, num_tokens: int
) -> np.ndarray:
    """Checksums of block positions ``[start, start + count)``."""
    out = np.zeros(count, dtype=np.uint64)
    for i in range(count):
        first = (start + i) * block_size
        valid = num_valid_tokens(start + i, block_size, num_tokens)
        out[i] = tokens[first : first + valid].sum(dtype=np.uint64)
    return out


def split_shares(
    rng: np.random.Generator, values: np.ndarray, n: int
) -> list[np.ndarray]:
    """``n`` random arrays that sum to ``values`` mod 2^64."""
    shares = [
        rng.integers(0, 2**64, size=values.shape, dtype=np.uint64) for _ in range(n - 1)
    ]
    last = values.copy()
    for share in shares:
        last -= share
    return [*shares, last]


@dataclass
class FakeWorkers:
    """What ``tp * pp`` workers report: each group's block checksums split in
    random shares (as TP shards and PP stages split them), one replica.
    Groups ``skipped`` (they cannot checksum) and ``unheld`` (no worker holds
    layers of them, e.g. drafter layers only) are not reported."""

    tp: int = 1
    pp: int = 1
    fingerprints: dict[int, int] = field(default_factory=lambda: {0: 0xF00D})
    skipped: frozenset[int] = frozenset()
    unheld: frozenset[int] = frozenset()
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def stage_fingerprints(self, pp_rank: int) -> dict[int, int]:
        # Stage 0 holds the group's whole fingerprint, later stages none:
        # their sum is what the scheduler compares.
        return {g: (fp if pp_rank == 0 else 0) for g, fp in self.fingerprints.items()}

    def report(
        self,
        req_id: str,
        values: Mapping[int, tuple[int, np.ndarray]],
        *,
        stored: Mapping[int, np.ndarray] | None = None,
        ranks: Sequence[tuple[int, int]] | None = None,
    ) -> list[KVChecksumRecord]:
        """Records of the workers in ``ranks`` (all by default) for one
        request; ``values`` per group: (start, checksum per block)."""
        all_ranks = [(pp, tp) for pp in range(self.pp) for tp in range(self.tp)]
        shares = {
            g: split_shares(self.rng, v, len(all_ranks))
            for g, (_, v) in values.items()
            if g not in self.skipped | self.unheld
        }
        records = []
        for i, (pp_rank, tp_rank) in enumerate(all_ranks):
            if ranks is not None and (pp_rank, tp_rank) not in ranks:
                continue
            groups = {
                g: KVChecksumGroup(
                    start=values[g][0],
                    replica_keys=[(1, 0)],
                    values=share[i][:, None],
                    stored=None if stored is None else stored[g],
                )
                for g, share in shares.items()
            }
            records.append(
                KVChecksumRecord(
                    pp_rank=pp_rank,
                    tp_rank=tp_rank,
                    checksums={req_id: groups},
                    skipped_groups=self.skipped,
                    fingerprints=self.stage_fingerprints(pp_rank),
                )
            )
        return records


def scheduled_values(
    blocks: KVChecksumBlocks,
    tokens: Mapping[int, np.ndarray],
    config: KVCacheConfig,
) -> dict[int, tuple[int, np.ndarray]]:
    """Per scheduled group, what a worker reports of ``tokens``: its first
    span and one checksum per span of its blocks (``checksum_spans``: a
    block, 16 tokens of a sliding-window block, or a state)."""
    values = {}
    for g, (start, block_ids) in blocks.groups.items():
        span, per_block = checksum_spans(config.kv_cache_groups[g].kv_cache_spec)
        first, count = start * per_block, len(block_ids) * per_block
        values[g] = (
            first,
            block_sums(tokens[g], span, first, count, blocks.num_tokens),
        )
    return values


def same_record(
    got: object,
    want: KVChecksumRecord,
    *,
    groups: Collection[int] | None = None,
    stored: bool = True,
) -> bool:
    """Whether ``got`` is a record holding what ``want`` does, as the
    scheduler reads it: replica keys as tuples, skipped groups as a set,
    and of those only ``groups`` if given (the scheduler looks up only the
    load's groups); ``stored`` values too unless told not to (only loads of
    offloaded KV read them)."""
    if type(got) is not KVChecksumRecord:
        return False
    skipped, want_skipped = set(got.skipped_groups), set(want.skipped_groups)
    if groups is not None:
        skipped &= set(groups)
        want_skipped &= set(groups)
    if (
        got.pp_rank,
        got.tp_rank,
        got.fingerprints,
        skipped,
        got.received,
        got.checksums.keys(),
    ) != (
        want.pp_rank,
        want.tp_rank,
        want.fingerprints,
        want_skipped,
        want.received,
        want.checksums.keys(),
    ):
        return False
    for req_id, want_groups in want.checksums.items():
        if got.checksums[req_id].keys() != want_groups.keys():
            return False
        for group_id, group in want_groups.items():
            other = got.checksums[req_id][group_id]
            if (
                other.start != group.start
                or [tuple(key) for key in other.replica_keys]
                != [tuple(key) for key in group.replica_keys]
                or other.values.dtype != group.values.dtype
                or not np.array_equal(other.values, group.values)
            ):
                return False
            if stored and not (
                (other.stored is None) == (group.stored is None)
                and (group.stored is None or np.array_equal(other.stored, group.stored))
            ):
                return False
    return True
