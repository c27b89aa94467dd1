"""Comparison of KV checksums: pure functions of the workers' records and the
producer's payload, without the scheduler's request bookkeeping
(:mod:`engine_patch.scheduler` collects the records and acts on the outcome).

A load from a producer is compared per group and chunk: the consumer's
workers' checksums are summed per copy of replicated KV heads
(:func:`sum_replicas`, one check per copy), both sides' spans are summed over
chunks of the larger span (:func:`chunk_sums`), and the chunks both sides
cover whole with as many tokens are compared (:func:`common_chunks`). A group
verifies only if every token the load must provide was compared. A load of
offloaded KV is compared per block with the values each worker stored with
it. Checksum v1 and why its sums compare across TP sizes and block sizes:
``docs/checksum.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import numpy as np

from engine_patch.config import KVChecksumConfig
from engine_patch.hashing import block_checksum_tags
from engine_patch.host import Request
from engine_patch.kv_cache import (
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    checksum_spans,
)
from engine_patch.payload import KVChecksumPayload
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    ReplicaKey,
    num_valid_tokens,
)

# Chunk positions, ascending without repeats: a range if consecutive.
Chunks: TypeAlias = range | np.ndarray

# Starts the message of every load failed by verification: the text a proxy
# looks for in a decode's error to tell an integrity failure from others.
KV_CHECKSUM_FAILURE_TEXT = "KV checksum mismatch"


class UnverifiedReason(enum.StrEnum):
    """Why a load, one of its groups, or a send cannot be checksummed: the
    fixed texts logged once each and counted in :class:`KVChecksumStats`."""

    NO_CHECKSUMS = "the producer sent no checksums"
    INVALID_CHECKSUMS = "the producer's checksums are invalid"
    INCOMPLETE = "not every worker reported its checksums"
    OTHER_BLOCKS = "a worker checksummed other blocks than scheduled"
    MISSING_REPLICA = "a replica was not checksummed"
    MAMBA_TP = "Mamba state without TP splits differs between TP sizes"
    ONE_SIDE = "a group is checksummed by one side only"
    # Its workers cannot checksum it (``KVChecksumRecord.skipped_groups``).
    SKIPPED = "a loaded group cannot be checksummed"
    # The fingerprints differ: other layers, KV heads, head size or dtype.
    OTHER_LAYERS = (
        "the producer's model differs (a group's layers, KV heads, head size or dtype)"
    )
    BLOCK_SIZES = "block sizes are not multiples of each other"
    START_INSIDE = "the first loaded block starts inside a producer block"
    NO_COMMON_BLOCK = "a group has no block in common"
    UNCOVERED = "some loaded tokens have no producer checksum to compare"
    GAP = "a group's loaded blocks are not consecutive"
    MALFORMED = "a worker's checksums are malformed"
    # A bug of the scheduler's own: it cannot compare what it was given.
    INTERNAL = "the checksums could not be compared (internal error)"
    NOTHING_CHECKSUMMED = "no loaded group can be checksummed"
    # Loaded inside the forward that uses it: no verdict can come first.
    SYNC_LOAD = "the connector loads synchronously, inside the forward"
    # Which tokens came from the producer is unknown.
    MIXED_SOURCES = "a load from the producer came partly from another cache tier"
    # Loads of offloaded KV only.
    NO_STORED = "a worker has no offloaded checksums of a loaded block"
    NO_BLOCK_HASH = "a loaded block has no block hash"


class Unverified(Exception):
    """A load, or one of its groups, that cannot be compared.

    ``reason`` is one of a few fixed messages, logged once each; ``detail``
    is logged per request at debug level.
    """

    def __init__(self, reason: UnverifiedReason, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class Comparison(NamedTuple):
    """A finished load compared with its expected checksums."""

    # Mismatching block positions per group.
    mismatches: dict[int, list[int]]
    # Why the load or some of its groups could not be compared.
    unverified: list[Unverified]
    # Groups compared (with or without mismatches).
    num_compared: int
    # Per group, positions of loaded blocks holding loaded tokens that were
    # not compared, in a group otherwise verified (sliding-window groups:
    # :meth:`KVChecksumComparer._uncompared`).
    uncompared: dict[int, list[int]]

    def failure_message(self, req_id: str) -> str:
        """The error of a load this comparison fails."""
        if self.mismatches:
            where = "; ".join(
                f"group {group_id} block positions {positions}"
                for group_id, positions in self.mismatches.items()
            )
            why = f"does not match the producer's checksums ({where})"
        else:
            reasons = dict.fromkeys(
                f"{e.reason} ({e.detail})" if e.detail else str(e.reason)
                for e in self.unverified
            )
            why = f"could not be verified: {'; '.join(reasons)}"
        return f"{KV_CHECKSUM_FAILURE_TEXT}: the KV loaded for request {req_id} {why}"


@dataclass
class PendingChecksums:
    """A request's blocks to compare and its workers' checksums of them, as
    they are collected."""

    blocks: KVChecksumBlocks
    # A load's first loaded token (after the consumer's cached prefix): the
    # tokens from there on must all be compared.
    first_token: int = 0
    # Groups whose blocks ``_blocks`` could not take (a null block after a
    # non-null one): loaded, but not checksummed.
    gaps: frozenset[int] = frozenset()
    # For a load of offloaded KV, its request: the load is checked against the
    # checksums offloaded with the KV (``KVChecksumGroup.stored``), not a
    # producer's.
    offload_request: Request | None = None
    # The producer's checksums; only for a load from a producer.
    expected: KVChecksumPayload | None = None
    # Why ``expected`` is None.
    missing_reason: UnverifiedReason = UnverifiedReason.NO_CHECKSUMS
    # Why a worker's report of the request is malformed, if one is.
    malformed: str | None = None
    # Why the load cannot be compared at all, whatever the workers report.
    unverifiable: UnverifiedReason | None = None
    # Per (pp_rank, tp_rank): its checksums of the request per group, and its
    # record.
    reports: dict[
        tuple[int, int], tuple[dict[int, KVChecksumGroup], KVChecksumRecord]
    ] = field(default_factory=dict)

    def set_expected(self, data: object) -> str | None:
        """Take the producer's payload; a malformed one (or not bytes) leaves
        the load unverified.

        Returns:
            Why the payload is malformed, or None if it was taken.

        """
        try:
            if not isinstance(data, bytes):
                raise ValueError(f"a {type(data).__name__}, not bytes")
            self.expected = KVChecksumPayload.from_bytes(data)
        except ValueError as e:
            self.missing_reason = UnverifiedReason.INVALID_CHECKSUMS
            return str(e)
        return None

    def check_complete(self, num_workers: int) -> None:
        """Check that every worker reported the request, in well-formed
        records (their ranks are checked to be in range as they come).

        Raises:
            Unverified: If not.

        """
        if self.malformed is not None:
            raise Unverified(UnverifiedReason.MALFORMED, self.malformed)
        if len(self.reports) < num_workers:
            raise Unverified(
                UnverifiedReason.INCOMPLETE,
                f"{len(self.reports)} of {num_workers} workers reported",
            )

    def skipped_groups(self) -> frozenset[int]:
        """Groups some worker cannot checksum."""
        if len(self.reports) == 1:
            # One worker (TP 1, PP 1): its own set, not a union of one.
            (_, record), *_ = self.reports.values()
            return frozenset(record.skipped_groups)
        return frozenset().union(*(r.skipped_groups for _, r in self.reports.values()))

    def fingerprint(self, group_id: int) -> int:
        """The group's fingerprint for the whole model: one TP rank's per PP
        stage (all of a stage's ranks hold the same layers), summed.

        Raises:
            Unverified: If the TP ranks of a stage disagree.

        """
        if len(self.reports) == 1:
            # One worker: its own fingerprint (a record's are below 2**64).
            (_, record), *_ = self.reports.values()
            return record.fingerprints.get(group_id, 0)
        stages: dict[int, int] = {}
        for (pp_rank, tp_rank), (_, record) in self.reports.items():
            fingerprint = record.fingerprints.get(group_id, 0)
            if stages.setdefault(pp_rank, fingerprint) != fingerprint:
                raise Unverified(
                    UnverifiedReason.MALFORMED,
                    f"group {group_id}: the fingerprint of worker "
                    f"{(pp_rank, tp_rank)} differs from its stage's",
                )
        return sum(stages.values()) % 2**64

    def group_checksums(self, group_id: int, per_block: int) -> list[KVChecksumGroup]:
        """Every worker's checksums of the group's scheduled blocks, at
        ``per_block`` spans per block (``checksum_spans``).

        Raises:
            Unverified: If a worker checksummed other blocks, e.g. those of
                an earlier prefill of a preempted request.

        """
        start, block_ids = self.blocks.groups[group_id]
        groups = []
        for worker, (checksums, record) in self.reports.items():
            group = checksums.get(group_id)
            # A worker checksums the groups it holds layers of and can.
            holds = (
                group_id in record.fingerprints
                and group_id not in record.skipped_groups
            )
            if holds != (group is not None):
                raise Unverified(
                    UnverifiedReason.INCOMPLETE,
                    f"group {group_id}: worker {worker} "
                    + ("left it out" if holds else "has no layers of it"),
                )
            if group is not None:
                groups.append(group)
        for group in groups:
            if group.start != start * per_block or group.values.shape != (
                len(block_ids) * per_block,
                len(group.replica_keys),
            ):
                raise Unverified(UnverifiedReason.OTHER_BLOCKS, f"group {group_id}")
        return groups


class KVChecksumComparer:
    """Compares a request's collected checksums, and sums a producer's into
    its payload, for one engine's transfer groups."""

    def __init__(
        self, config: KVChecksumConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.tp_size = config.tp_size
        self.num_workers = config.tp_size * config.pp_size
        # The groups KV transfers write: those checksummed and compared.
        self.groups: dict[int, KVCacheGroup] = {
            group_id: kv_cache_config.kv_cache_groups[group_id]
            for group_id in kv_cache_config.transfer_group_ids
        }
        # Per group: tokens per checksum value and values per block.
        self.spans = {
            group_id: checksum_spans(group.kv_cache_spec)
            for group_id, group in self.groups.items()
        }
        self._hash_block_size = kv_cache_config.hash_block_size

    def block_size(self, group_id: int) -> int:
        """Tokens per block of a transfer group."""
        return self.groups[group_id].kv_cache_spec.block_size

    def payload(self, pending: PendingChecksums) -> KVChecksumPayload:
        """A producer's payload: the sum of every worker's checksums.

        Raises:
            Unverified: If some are missing or malformed.

        """
        pending.check_complete(self.num_workers)
        skipped = pending.skipped_groups()
        groups: dict[int, tuple[int, int, int, np.ndarray]] = {}
        for group_id, (start, block_ids) in pending.blocks.groups.items():
            if group_id in skipped:
                continue
            span, per_block = self.spans[group_id]
            checksums = pending.group_checksums(group_id, per_block)
            if not checksums:
                # No worker checksums it, e.g. it holds only drafter layers.
                continue
            if len(checksums) == 1 and checksums[0].values.shape[1] == 1:
                values = checksums[0].values[:, 0]
            else:
                values = np.zeros(len(block_ids) * per_block, dtype=np.uint64)
                for group in checksums:
                    values += group.values.sum(axis=1, dtype=np.uint64)
            # The payload's unit is the span: its "block size" and start.
            groups[group_id] = (
                pending.fingerprint(group_id),
                span,
                start * per_block,
                values,
            )
        return KVChecksumPayload(self.tp_size, pending.blocks.num_tokens, groups)

    def compare(self, pending: PendingChecksums) -> Comparison:
        """The mismatching block positions per group, why the load or some of
        its groups could not be compared, how many groups were, and which
        loaded blocks hold tokens that were not compared."""
        try:
            if pending.unverifiable is not None:
                raise Unverified(pending.unverifiable)
            pending.check_complete(self.num_workers)
            if pending.offload_request is None and pending.expected is None:
                raise Unverified(pending.missing_reason)
        except Unverified as e:
            return Comparison({}, [e], 0, {})
        mismatches: dict[int, list[int]] = {}
        uncompared: dict[int, list[int]] = {}
        unverified: list[Unverified] = []
        skipped = pending.skipped_groups()
        num_compared = 0
        for group_id in sorted(pending.gaps):
            unverified.append(Unverified(UnverifiedReason.GAP, f"group {group_id}"))
        for group_id in pending.blocks.groups:
            try:
                if pending.offload_request is not None:
                    bad = self._compare_stored(pending, group_id, group_id in skipped)
                else:
                    assert pending.expected is not None
                    bad = self._compare_group(
                        pending,
                        pending.expected,
                        group_id,
                        group_id in skipped,
                        uncompared,
                    )
            except Unverified as e:
                unverified.append(e)
                continue
            if bad is None:
                continue
            num_compared += 1
            if bad:
                mismatches[group_id] = bad
        # A reload of groups no worker holds layers of has nothing to check.
        if not num_compared and not unverified and pending.offload_request is None:
            unverified.append(Unverified(UnverifiedReason.NOTHING_CHECKSUMMED))
        return Comparison(mismatches, unverified, num_compared, uncompared)

    def _compare_group(
        self,
        pending: PendingChecksums,
        expected: KVChecksumPayload,
        group_id: int,
        skipped: bool,
        uncompared: dict[int, list[int]],
    ) -> list[int] | None:
        """The group's mismatching block positions, or None if the group is
        not compared (no worker of either side holds layers of it).

        Compared per span (``checksum_spans``); with different spans, sums of
        the smaller ones are compared with the larger ones. Without a
        mismatch, the group verifies only if every token the load must
        provide was compared (:meth:`_check_covered`); loaded blocks that
        still hold tokens not compared go into ``uncompared``.

        Raises:
            Unverified: If the group cannot be compared.

        """
        spec = self.groups[group_id].kv_cache_spec
        if (
            isinstance(spec, MambaSpec)
            and spec.state_splits is None
            and not spec.tp_replicated
            and expected.tp_size != self.tp_size
        ):
            # Without its TP splits, a rank's share of sharded state depends on
            # the TP size.
            raise Unverified(
                UnverifiedReason.MAMBA_TP,
                f"group {group_id}: producer TP {expected.tp_size}, "
                f"consumer TP {self.tp_size}",
            )
        span, per_block = self.spans[group_id]
        sent = expected.groups.get(group_id)
        checksums = [] if skipped else pending.group_checksums(group_id, per_block)
        # No worker checksums a group of only drafter layers, as if skipped.
        unchecked = not checksums
        if unchecked or sent is None:
            if unchecked != (sent is None):
                raise Unverified(
                    UnverifiedReason.ONE_SIDE,
                    f"group {group_id} on the "
                    f"{'producer' if unchecked else 'consumer'} only",
                )
            if skipped:
                # Loaded, never compared: not verified.
                raise Unverified(UnverifiedReason.SKIPPED, f"group {group_id}")
            return None
        # The payload's "block size" and start are in spans.
        fingerprint, sent_span, sent_start, sent_values = sent
        if fingerprint != pending.fingerprint(group_id):
            raise Unverified(UnverifiedReason.OTHER_LAYERS, f"group {group_id}")
        start, block_ids = pending.blocks.groups[group_id]
        if _same_spans_match(
            pending, expected, checksums, sent, start * per_block, span
        ):
            return []
        if isinstance(spec, MambaSpec):
            # One state, not tokens: whatever a producer calls its span.
            sent_span = 1
        chunk_size = max(span, sent_span)
        if chunk_size % min(span, sent_span):
            raise Unverified(
                UnverifiedReason.BLOCK_SIZES,
                f"group {group_id}: checksums of {sent_span} tokens on the "
                f"producer, {span} on the consumer",
            )
        spans_per_chunk = chunk_size // span
        num_tokens = pending.blocks.num_tokens
        sent_first, sent_sums = chunk_sums(
            sent_values, sent_start, sent_span, chunk_size, expected.num_tokens
        )
        checks = [
            chunk_sums(values, start * per_block, span, chunk_size, num_tokens)
            for values in sum_replicas(checksums, len(block_ids) * per_block)
        ]
        first, num_chunks = checks[0][0], len(checks[0][1])
        chunks = common_chunks(
            (first, first + num_chunks),
            (sent_first, sent_first + len(sent_sums)),
            # A state has no tokens; only a last chunk can hold fewer on one side.
            None if isinstance(spec, MambaSpec) else chunk_size,
            num_tokens,
            expected.num_tokens,
        )
        if isinstance(chunks, range):
            # Consecutive (the usual case): compared as slices, as bytes
            # (each numpy call costs microseconds when an engine step has
            # evicted numpy from the caches).
            lo, hi = chunks.start, chunks.stop
            want = sent_sums[lo - sent_first : hi - sent_first].tobytes()
            matches = all(
                sums[lo - first : hi - first].tobytes() == want for _, sums in checks
            )
        else:
            matches = all(
                np.array_equal(sums[chunks - first], sent_sums[chunks - sent_first])
                for _, sums in checks
            )
        if matches:
            self._check_covered(pending, group_id, chunks, chunk_size)
            if isinstance(spec, SlidingWindowSpec) and (
                positions := self._uncompared(pending, group_id, chunks, chunk_size)
            ):
                uncompared[group_id] = positions
            return []
        indices = np.asarray(chunks)
        bad = np.zeros(len(indices), dtype=bool)
        for _, sums in checks:
            bad |= sums[indices - first] != sent_sums[indices - sent_first]
        end = start + len(block_ids)
        # The consumer's blocks holding a bad chunk's spans.
        return sorted(
            {
                pos
                for chunk in indices[bad].tolist()
                for pos in range(
                    max(start, chunk * spans_per_chunk // per_block),
                    min(end, cdiv((chunk + 1) * spans_per_chunk, per_block)),
                )
            }
        )

    def _check_covered(
        self,
        pending: PendingChecksums,
        group_id: int,
        chunks: Chunks,
        chunk_size: int,
    ) -> None:
        """Check that the compared ``chunks`` (ascending, of ``chunk_size``
        tokens) cover every token of the group the load must provide: those
        from its first loaded token; for a sliding-window group only the
        window the request reads from (the consumer's first kept block can
        start before what its producer kept, and the transfer writes no KV
        there); for a state group the state.

        Raises:
            Unverified: If some are not compared, naming them.

        """
        spec = self.groups[group_id].kv_cache_spec
        num_tokens = pending.blocks.num_tokens
        if isinstance(spec, MambaSpec):
            lo_token, hi_token, lo, hi = 0, 1, 0, 1
        else:
            lo_token = pending.first_token
            if isinstance(spec, SlidingWindowSpec):
                # The last loaded token, if computed again, reads this far back.
                lo_token = max(lo_token, num_tokens - spec.sliding_window)
            hi_token = num_tokens
            lo, hi = lo_token // chunk_size, cdiv(hi_token, chunk_size)
        if _covers(chunks, lo, hi):
            return
        if isinstance(spec, MambaSpec):
            where = "the state"
        else:
            missing = np.setdiff1d(np.arange(lo, hi), chunks, assume_unique=True)
            where = "tokens " + token_ranges(missing, chunk_size, lo_token, hi_token)
            where += f" of the loaded [{lo_token}, {hi_token})"
        if (
            not isinstance(spec, MambaSpec)
            and not (len(chunks) and chunks[0] == lo)
            and pending.blocks.groups[group_id][0] * spec.block_size > lo * chunk_size
        ):
            # The consumer's first block starts inside the first chunk.
            reason = UnverifiedReason.START_INSIDE
        elif not len(chunks):
            reason = UnverifiedReason.NO_COMMON_BLOCK
        else:
            reason = UnverifiedReason.UNCOVERED
        raise Unverified(reason, f"group {group_id}: {where}")

    def _uncompared(
        self,
        pending: PendingChecksums,
        group_id: int,
        chunks: Chunks,
        chunk_size: int,
    ) -> list[int]:
        """Positions of the group's loaded blocks holding loaded tokens that
        no compared chunk (ascending, of ``chunk_size`` tokens) covers.

        A verified sliding-window group can have them: the consumer's first
        kept block may start before what its producer kept, and the transfer
        wrote nothing there. The request never reads those tokens (they are
        outside its window), but another request whose window holds them
        would, were the block reused.
        """
        block_size = self.block_size(group_id)
        start, block_ids = pending.blocks.groups[group_id]
        num_tokens = pending.blocks.num_tokens
        lo = max(start * block_size, pending.first_token)
        hi = min((start + len(block_ids)) * block_size, num_tokens)
        if _covers(chunks, lo // chunk_size, cdiv(hi, chunk_size)):
            return []  # The usual case: every loaded token was compared.
        return [
            pos
            for pos in range(start, start + len(block_ids))
            if not _covers(
                chunks,
                max(pos * block_size, lo) // chunk_size,
                cdiv(min((pos + 1) * block_size, hi), chunk_size),
            )
        ]

    def _compare_stored(
        self, pending: PendingChecksums, group_id: int, skipped: bool
    ) -> list[int] | None:
        """The mismatching block positions in a group of a load of offloaded
        KV: each worker's checksums against those offloaded with the KV it
        loaded, untagged with the ``block_checksum_tags`` of the blocks the
        request expects there. None if no worker holds layers of the group
        (e.g. drafter layers only).

        Raises:
            Unverified: If some worker cannot checksum the group (``skipped``:
                its reloaded KV is not all compared), a worker checksummed
                other blocks than scheduled, or a compared block has no
                stored value or block hash.

        """
        if skipped:
            raise Unverified(UnverifiedReason.SKIPPED, f"group {group_id}")
        _, per_block = self.spans[group_id]
        if not pending.group_checksums(group_id, per_block):
            return None
        assert pending.offload_request is not None
        block_size = self.groups[group_id].kv_cache_spec.block_size
        hashes_per_block = block_size // (self._hash_block_size or block_size)
        request_hashes = pending.offload_request.block_hashes
        start, block_ids = pending.blocks.groups[group_id]
        ends = [
            (pos + 1) * hashes_per_block for pos in range(start, start + len(block_ids))
        ]
        if hashes_per_block < 1 or ends[-1] > len(request_hashes):
            raise Unverified(
                UnverifiedReason.NO_BLOCK_HASH,
                f"group {group_id}: {len(request_hashes)} block hashes, "
                f"block positions up to {start + len(block_ids) - 1}",
            )
        block_hashes = [request_hashes[end - 1] for end in ends]
        bad: set[int] = set()
        for checksums, record in pending.reports.values():
            if (group := checksums.get(group_id)) is None:
                continue
            fingerprint = record.fingerprints.get(group_id)
            if (
                group.stored is None
                or group.stored.shape != (len(block_ids),)
                or fingerprint is None
            ):
                raise Unverified(
                    UnverifiedReason.NO_STORED,
                    f"group {group_id} on worker {record.pp_rank, record.tp_rank}",
                )
            tags = block_checksum_tags(block_hashes, fingerprint)
            # Stored values are per block: the sums of its spans.
            sums = (
                group.values.sum(axis=1, dtype=np.uint64)
                .reshape(len(block_ids), per_block)
                .sum(axis=1, dtype=np.uint64)
            )
            bad.update((np.flatnonzero(sums ^ tags != group.stored) + start).tolist())
        return sorted(bad)


def _same_spans_match(
    pending: PendingChecksums,
    expected: KVChecksumPayload,
    checksums: list[KVChecksumGroup],
    sent: tuple[int, int, int, np.ndarray],
    span_start: int,
    span: int,
) -> bool:
    """Whether a group verifies as the usual load does: one consumer worker
    holding every head once, the same spans at the same start and as many
    tokens on both sides, every value equal, and every token from the first
    loaded one compared.

    Only a shortcut for that case: ``False`` says nothing, and the group is
    then compared in general (:meth:`KVChecksumComparer._compare_group`),
    which verifies these loads too (a sliding window or a state asks no
    more than every loaded token compared).
    """
    _, sent_span, sent_start, sent_values = sent
    if (
        sent_span != span
        or sent_start != span_start
        or expected.num_tokens != pending.blocks.num_tokens
        or len(checksums) != 1
        or checksums[0].replica_keys != [(1, 0)]
    ):
        return False
    # group_checksums checked the consumer's shape: one value per span.
    values = checksums[0].values[:, 0]
    end = span_start + len(values)
    # Equal bytes are as many values.
    return (
        span_start <= pending.first_token // span
        and cdiv(pending.blocks.num_tokens, span) <= end
        and values.tobytes() == sent_values.tobytes()
    )


def _covers(chunks: Chunks, lo: int, hi: int) -> bool:
    """Whether ``chunks`` (ascending, without repeats) holds every chunk of
    ``[lo, hi)``: iff that many of it lie in the range."""
    if lo >= hi:
        return True
    if len(chunks) and chunks[-1] - chunks[0] == len(chunks) - 1:
        # Consecutive (the usual case): the range must lie within them.
        return bool(chunks[0] <= lo and hi <= chunks[-1] + 1)
    within = np.searchsorted(chunks, [lo, hi])
    return bool(within[1] - within[0] == hi - lo)


def chunk_sums(
    values: np.ndarray,
    start: int,
    block_size: int,
    chunk_size: int,
    num_tokens: int,
) -> tuple[int, np.ndarray]:
    """Sums of the checksums of consecutive blocks over chunks of
    ``chunk_size`` tokens: the first chunk and one sum per chunk.

    Args:
        values: Checksums of consecutive blocks.
        start: Position of the first block.
        block_size: Tokens per block.
        chunk_size: A multiple of ``block_size``.
        num_tokens: Tokens checksummed; blocks past them are zero.

    Returns:
        The first chunk the blocks cover whole and the sums of the chunks
        they cover whole.

    """
    blocks_per_chunk = chunk_size // block_size
    end = start + len(values)
    first = cdiv(start, blocks_per_chunk)
    if end >= cdiv(num_tokens, block_size):
        # The blocks missing from the last chunk are past the tokens, zero:
        # it is whole too. (Summed without padding, which a bogus producer
        # block size would make huge.)
        last = cdiv(end, blocks_per_chunk)
    else:
        last = end // blocks_per_chunk
    count = last - first
    if count <= 0:
        return first, np.zeros(0, dtype=np.uint64)
    # Index of the first chunk's first block in ``values``; below
    # ``len(values)``, as the chunk starts before ``end``.
    lo = first * blocks_per_chunk - start
    if blocks_per_chunk == 1:
        return first, values[lo : lo + count]
    full = min(count, (len(values) - lo) // blocks_per_chunk)
    sums = (
        values[lo : lo + full * blocks_per_chunk]
        .reshape(full, blocks_per_chunk)
        .sum(axis=1, dtype=np.uint64)
    )
    if full < count:
        # The last chunk, whose missing blocks are past the tokens.
        tail = values[lo + full * blocks_per_chunk :].sum(dtype=np.uint64)
        sums = np.append(sums, tail)
    return first, sums


def token_ranges(
    chunks: np.ndarray, chunk_size: int, lo_token: int, hi_token: int
) -> str:
    """The tokens of ascending ``chunks`` within ``[lo_token, hi_token)``, as
    ranges: ``"[32, 48), [64, 70)"``."""
    ranges: list[list[int]] = []
    for chunk in chunks.tolist():
        begin = max(lo_token, chunk * chunk_size)
        end = min(hi_token, (chunk + 1) * chunk_size)
        if ranges and ranges[-1][1] == begin:
            ranges[-1][1] = end
        else:
            ranges.append([begin, end])
    return ", ".join(f"[{begin}, {end})" for begin, end in ranges)


def common_chunks(
    chunks: tuple[int, int],
    sent_chunks: tuple[int, int],
    chunk_size: int | None,
    num_tokens: int,
    sent_num_tokens: int,
) -> Chunks:
    """The chunks in both ranges ``[first, end)`` that hold as many tokens on
    both sides (all of them if ``chunk_size`` is None), ascending: a range
    if they are consecutive."""
    lo = max(chunks[0], sent_chunks[0])
    hi = min(chunks[1], sent_chunks[1])
    if lo >= hi:
        return range(0)
    if chunk_size is None or num_tokens == sent_num_tokens:
        # Every chunk holds as many tokens on both sides (the usual load).
        return range(lo, hi)
    # Chunks below ``split`` are full on both sides; only the few after it
    # are counted one by one.
    split = min(max(lo, min(num_tokens, sent_num_tokens) // chunk_size), hi)
    tail = [
        chunk
        for chunk in range(split, hi)
        if num_valid_tokens(chunk, chunk_size, num_tokens)
        == num_valid_tokens(chunk, chunk_size, sent_num_tokens)
    ]
    if tail == list(range(split, split + len(tail))):
        return range(lo, split + len(tail))
    return np.concatenate([np.arange(lo, split), np.array(tail, dtype=np.int64)])


def sum_replicas(groups: list[KVChecksumGroup], num_positions: int) -> list[np.ndarray]:
    """The consumer's checksums of a group, one per check. Check ``k`` sums
    copy ``k % R`` of each layer replicated on ``R`` ranks, so every check
    covers each layer once and every copy is checked.

    Raises:
        Unverified: If a check misses a copy.

    """
    if len(groups) == 1 and groups[0].replica_keys == [(1, 0)]:
        # One worker holding every head once (TP 1): no sums to make.
        return [groups[0].values[:, 0]]
    totals: dict[ReplicaKey, np.ndarray] = {}
    for group in groups:
        for column, key in enumerate(group.replica_keys):
            total = totals.setdefault(key, np.zeros(num_positions, dtype=np.uint64))
            total += group.values[:, column]
    replica_counts = {replicas for replicas, _ in totals}
    checks = []
    for k in range(max(replica_counts, default=1)):
        check = np.zeros(num_positions, dtype=np.uint64)
        for replicas in replica_counts:
            if (copy := totals.get((replicas, k % replicas))) is None:
                raise Unverified(
                    UnverifiedReason.MISSING_REPLICA,
                    f"replica {k % replicas} of {replicas}",
                )
            check += copy
        checks.append(check)
    return checks
