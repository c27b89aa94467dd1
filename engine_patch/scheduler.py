"""Scheduler-side KV checksums: the blocks workers checksum, and verification
of loads against the producer's checksums.

Requests are checksummed by their P/D role in their ``kv_transfer_params``: a
producer request (``do_remote_decode``) when its prompt's KV is final, and a
consumer request (``do_remote_prefill``) once its KV load finishes. A
producer's checksums are added to the ``kv_transfer_params`` it returns, if
any, for the proxy to forward to the consumer with the request, and are given
to the connector (:meth:`KVChecksumScheduler.take_kv_checksums_to_send`) for
connectors that send them in their own messages. A consumer uses the checksums
in its request's ``kv_transfer_params``, or those its connector received with
the load.

A load of offloaded KV, whose connector offloaded checksums with the KV, is
checked once it finishes against those checksums instead: each worker's
checksums against the ones it offloaded
(``KVChecksumWorker.init_block_checksums``).

A load verifies only if every token it loaded was compared (for a
sliding-window group, every token of the window the request reads);
otherwise it is unverified, with the uncovered tokens in the detail. Loads
that mismatch or cannot be verified fail under ``fail_closed`` (the
default); under fail-open they are logged and counted and proceed.
"""

from __future__ import annotations

import base64
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from engine_patch.config import KVChecksumConfig
from engine_patch.hashing import block_checksum_tags
from engine_patch.host import (
    Block,
    CacheHitSource,
    FinishReason,
    KVCacheBlocks,
    KVCacheManager,
    KVChecksumConnector,
    KVConnectorOutput,
    Request,
)
from engine_patch.kv_cache import (
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
    checksum_spans,
    clip_ssm_state_blocks,
    sliding_window_transfer_blocks,
)
from engine_patch.log import warning_once
from engine_patch.payload import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumPayload,
    decode_base64,
)
from engine_patch.records import checksums_problem, record_problem, requests_named
from engine_patch.stats import KVChecksumStats
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
    ReplicaKey,
    num_valid_tokens,
)

logger = logging.getLogger(__name__)

# Starts the message of every load failed by verification: the text a proxy
# looks for in a decode's error to tell an integrity failure from others.
KV_CHECKSUM_FAILURE_TEXT = "KV checksum mismatch"

# Finishes whose KV a producer sends; an aborted or failed request's is not.
_SENT_FINISH_REASONS = frozenset({FinishReason.STOP, FinishReason.LENGTH})


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
    # Loads of offloaded KV only.
    NO_STORED = "a worker has no offloaded checksums of a loaded block"
    NO_BLOCK_HASH = "a loaded block has no block hash"


class _Unverified(Exception):
    """A load, or one of its groups, that cannot be compared.

    ``reason`` is one of a few fixed messages, logged once each; ``detail``
    is logged per request at debug level.
    """

    def __init__(self, reason: UnverifiedReason, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class _Comparison(NamedTuple):
    """A finished load compared with its expected checksums."""

    # Mismatching block positions per group.
    mismatches: dict[int, list[int]]
    # Why the load or some of its groups could not be compared.
    unverified: list[_Unverified]
    # Groups compared (with or without mismatches).
    num_compared: int

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
class _Pending:
    """A request whose checksums are being collected from the workers."""

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
    # Per (pp_rank, tp_rank): its checksums of the request per group, and its
    # record.
    reports: dict[
        tuple[int, int], tuple[dict[int, KVChecksumGroup], KVChecksumRecord]
    ] = field(default_factory=dict)

    def set_expected(self, req_id: str, data: object) -> None:
        """Take the producer's payload; a malformed one (or not bytes) leaves
        the load unverified."""
        try:
            if not isinstance(data, bytes):
                raise ValueError(f"a {type(data).__name__}, not bytes")
            self.expected = KVChecksumPayload.from_bytes(data)
        except ValueError as e:
            self.missing_reason = UnverifiedReason.INVALID_CHECKSUMS
            logger.debug("Invalid KV checksums for request %s: %s", req_id, e)

    def check_complete(self, num_workers: int) -> None:
        """Check that every worker reported the request, in well-formed
        records (their ranks are checked to be in range as they come).

        Raises:
            _Unverified: If not.

        """
        if self.malformed is not None:
            raise _Unverified(UnverifiedReason.MALFORMED, self.malformed)
        if len(self.reports) < num_workers:
            raise _Unverified(
                UnverifiedReason.INCOMPLETE,
                f"{len(self.reports)} of {num_workers} workers reported",
            )

    def skipped_groups(self) -> frozenset[int]:
        """Groups some worker cannot checksum."""
        return frozenset().union(*(r.skipped_groups for _, r in self.reports.values()))

    def fingerprint(self, group_id: int) -> int:
        """The group's fingerprint for the whole model: one TP rank's per PP
        stage (all of a stage's ranks hold the same layers), summed.

        Raises:
            _Unverified: If the TP ranks of a stage disagree.

        """
        stages: dict[int, int] = {}
        for (pp_rank, tp_rank), (_, record) in self.reports.items():
            fingerprint = record.fingerprints.get(group_id, 0)
            if stages.setdefault(pp_rank, fingerprint) != fingerprint:
                raise _Unverified(
                    UnverifiedReason.MALFORMED,
                    f"group {group_id}: the fingerprint of worker "
                    f"{(pp_rank, tp_rank)} differs from its stage's",
                )
        return sum(stages.values()) % 2**64

    def group_checksums(self, group_id: int, per_block: int) -> list[KVChecksumGroup]:
        """Every worker's checksums of the group's scheduled blocks, at
        ``per_block`` spans per block (``checksum_spans``).

        Raises:
            _Unverified: If a worker checksummed other blocks, e.g. those of
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
                raise _Unverified(
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
                raise _Unverified(UnverifiedReason.OTHER_BLOCKS, f"group {group_id}")
        return groups


class KVChecksumScheduler:
    """Schedules KV checksums and verifies loaded KV against the producer's.

    The host calls, per request and step: :meth:`on_new_request` when a
    request arrives; :meth:`add_send` for each scheduled request once its
    ``num_computed_tokens`` include the step's tokens; :meth:`add_recv` when
    a KV load starts; :meth:`build_checksum_meta` for the step's workers;
    :meth:`update_from_output` with their output; :meth:`request_finished`
    after the connector's ``request_finished``.
    """

    def __init__(
        self,
        config: KVChecksumConfig,
        kv_cache_config: KVCacheConfig,
        connector: KVChecksumConnector,
    ) -> None:
        self._connector = connector
        self._tp_size = config.tp_size
        self._pp_size = config.pp_size
        self._num_workers = config.tp_size * config.pp_size
        self._fail_closed = config.fail_closed
        self._groups: dict[int, KVCacheGroup] = {
            group_id: kv_cache_config.kv_cache_groups[group_id]
            for group_id in kv_cache_config.transfer_group_ids
        }
        # Per group: tokens per checksum value and values per block.
        self._spans = {
            group_id: checksum_spans(group.kv_cache_spec)
            for group_id, group in self._groups.items()
        }
        self._hash_block_size = kv_cache_config.hash_block_size
        self._sends: dict[str, _Pending] = {}
        self._recvs: dict[str, _Pending] = {}
        # Consumer requests whose KV load has not started yet.
        self._remote_prefills: set[str] = set()
        self._to_send: dict[str, bytes] = {}
        self._failures: dict[str, str] = {}
        self._mismatched: dict[str, dict[int, list[int]]] = {}
        self._scheduled = KVChecksumScheduled()
        self.stats = KVChecksumStats()

    @classmethod
    def create(
        cls,
        config: KVChecksumConfig,
        kv_cache_config: KVCacheConfig,
        connector: KVChecksumConnector | None,
    ) -> KVChecksumScheduler | None:
        """The scheduler, or None if checksums are disabled or the engine has
        no KV connector (nothing is transferred)."""
        if connector is None or not config.enabled:
            return None
        return cls(config, kv_cache_config, connector)

    @property
    def fail_closed(self) -> bool:
        """Whether mismatched and unverified loads fail."""
        return self._fail_closed

    def on_new_request(self, request: Request) -> None:
        """Note a consumer request, before its connector starts its load (and
        may clear ``do_remote_prefill``).

        A request that also has ``do_remote_decode`` is a producer reloading
        its consumer's KV of an earlier turn (NIXL's bidirectional transfer):
        not checksummed.
        """
        params = request.kv_transfer_params
        if (
            params
            and params.get("do_remote_prefill")
            and not params.get("do_remote_decode")
        ):
            self._remote_prefills.add(request.request_id)

    def add_send(
        self,
        request: Request,
        num_scheduled_tokens: int,
        kv_cache_manager: KVCacheManager,
    ) -> None:
        """Checksum a producer request's KV if this step, which schedules
        ``num_scheduled_tokens`` of it, finishes its prompt, for its consumer
        to verify after loading it.

        ``request.num_computed_tokens`` must already include this step's
        tokens.
        """
        num_tokens = request.num_computed_tokens
        num_prompt_tokens = request.num_prompt_tokens
        if not num_tokens - num_scheduled_tokens < num_prompt_tokens <= num_tokens:
            return
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return
        blocks = kv_cache_manager.get_blocks(request.request_id)
        checksum_blocks, _ = self._blocks(blocks, 0, num_tokens)
        # A new prefill (after a preemption) replaces an earlier one.
        self._sends[request.request_id] = _Pending(checksum_blocks)
        self._scheduled.reqs_to_send[request.request_id] = checksum_blocks
        logger.debug(
            "Checksumming the KV of producer request %s (%d tokens).",
            request.request_id,
            num_tokens,
        )

    def add_recv(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_local_computed_tokens: int,
    ) -> None:
        """Checksum the blocks a load starting this step writes, once it
        finishes: a consumer request's load from its producer, or a load of
        offloaded KV whose connector offloaded checksums with it
        (``KVChecksumConnector.get_kv_checksum_sources``).

        ``request.num_computed_tokens`` must already include the loaded
        tokens.
        """
        req_id = request.request_id
        remote_prefill = req_id in self._remote_prefills
        self._remote_prefills.discard(req_id)
        sources = frozenset(
            self._connector.get_external_cache_hit_sources(
                request, request.num_computed_tokens - num_local_computed_tokens
            )
        )
        if not remote_prefill:
            if sources and sources <= self._connector.get_kv_checksum_sources(request):
                checksum_blocks, gaps = self._blocks(
                    blocks, num_local_computed_tokens, request.num_computed_tokens
                )
                self._recvs[req_id] = _Pending(
                    checksum_blocks,
                    num_local_computed_tokens,
                    gaps,
                    offload_request=request,
                )
                self._scheduled.reqs_to_load[req_id] = checksum_blocks
            return
        if sources != {CacheHitSource.P2P}:
            return
        checksum_blocks, gaps = self._blocks(
            blocks, num_local_computed_tokens, request.num_computed_tokens
        )
        pending = _Pending(checksum_blocks, num_local_computed_tokens, gaps)
        params = request.kv_transfer_params or {}
        if (encoded := params.get(KV_TRANSFER_PARAMS_KEY)) is not None:
            # Not base64 text: b"", not a payload either.
            pending.set_expected(req_id, decode_base64(encoded))
        self._recvs[req_id] = pending
        self._scheduled.reqs_to_recv[req_id] = checksum_blocks

    def build_checksum_meta(self) -> KVChecksumScheduled | None:
        """The requests this step's workers checksum; resets them."""
        scheduled = self._scheduled
        if not (
            scheduled.reqs_to_send or scheduled.reqs_to_recv or scheduled.reqs_to_load
        ):
            return None
        self._scheduled = KVChecksumScheduled()
        return scheduled

    def update_from_output(
        self,
        kv_connector_output: KVConnectorOutput | None,
        skip_req_ids: set[str],
    ) -> set[str]:
        """Collect the workers' checksums and verify the finished loads.

        Args:
            kv_connector_output: The step's aggregated connector output.
            skip_req_ids: Requests whose load already failed; not verified.

        Returns:
            The requests whose load fails verification: under fail-closed,
            those mismatching or unverified; under fail-open none. The
            connector hears of a mismatching load of offloaded KV in
            ``on_kv_checksum_failure`` in both modes (so it can drop the bad
            copy), and of an unverified one under fail-closed only (where the
            load fails).

        """
        if kv_connector_output is None:
            return set()
        for record in kv_connector_output.kv_checksums or ():
            self._take_record(record)

        failed: set[str] = set()
        for req_id in kv_connector_output.finished_recving or ():
            pending = self._recvs.pop(req_id, None)
            if pending is None or req_id in skip_req_ids:
                continue
            try:
                outcome = self._verify(req_id, pending)
            except Exception:
                # Never out of the engine's scheduler: what cannot be
                # compared is unverified.
                logger.exception("KV checksums of request %s not compared.", req_id)
                self.stats.unverified[UnverifiedReason.INTERNAL] += 1
                outcome = _Comparison({}, [_Unverified(UnverifiedReason.INTERNAL)], 0)
            if outcome is None:
                continue
            mismatches = outcome.mismatches
            if mismatches:
                self._mismatched[req_id] = mismatches
            if pending.offload_request is not None and (
                mismatches or self._fail_closed
            ):
                self._connector.on_kv_checksum_failure(
                    pending.offload_request, mismatches
                )
            if self._fail_closed:
                failed.add(req_id)
                self._failures[req_id] = outcome.failure_message(req_id)
        return failed

    def take_mismatched_loads(self) -> dict[str, dict[int, list[int]]]:
        """Every load that mismatched since the last call, under
        fail-closed and fail-open alike: request id -> its mismatching block
        positions per group.

        The host must never let another request reuse such a load's KV:
        none of the request's blocks from its first loaded one on (nor those
        it computes later, which derive from them) may enter its prefix
        cache. Under fail-open the request itself goes on with the KV it
        loaded (its answer may be wrong: that is what fail-open accepts);
        under fail-closed it is also among :meth:`update_from_output`'s
        failed loads. Unverified loads are not named: nothing says their KV
        is bad.
        """
        mismatched, self._mismatched = self._mismatched, {}
        return mismatched

    def _take_record(self, record: object) -> None:
        """File a worker's report under the requests it has checksums of; a
        malformed one leaves them unverified (or unsent)."""
        problem = record_problem(record, tp_size=self._tp_size, pp_size=self._pp_size)
        if problem is not None:
            for req_id in requests_named(record):
                if (pending := self._pending(req_id)) is not None:
                    pending.malformed = problem
            warning_once(logger, "Malformed KV checksum record: %s.", problem)
            return
        assert isinstance(record, KVChecksumRecord)
        worker = (record.pp_rank, record.tp_rank)
        for req_id, groups in record.checksums.items():
            if (pending := self._pending(req_id)) is None:
                continue
            problem = checksums_problem(groups, tp_size=self._tp_size)
            if problem is not None:
                pending.malformed = f"worker {worker}: {problem}"
                continue
            pending.reports[worker] = (groups, record)
        for req_id, data in record.received.items():
            pending = self._recvs.get(req_id)
            if pending is not None and pending.expected is None:
                pending.set_expected(req_id, data)

    def _pending(self, req_id: str) -> _Pending | None:
        return self._sends.get(req_id) or self._recvs.get(req_id)

    def take_load_failures(self) -> dict[str, str]:
        """Why each load failed by :meth:`update_from_output` since the last
        call: request id -> a message starting with
        :data:`KV_CHECKSUM_FAILURE_TEXT`, for the request's error."""
        failures, self._failures = self._failures, {}
        return failures

    def request_finished(
        self, request: Request, kv_transfer_params: dict[str, Any] | None
    ) -> None:
        """Send a producer request's checksums: added to the
        ``kv_transfer_params`` it returns, if any, and given to the connector
        (see :meth:`take_kv_checksums_to_send`).

        Called for every finished request, after the connector's
        ``request_finished``; drops the request's state.
        """
        req_id = request.request_id
        self._remote_prefills.discard(req_id)
        self._recvs.pop(req_id, None)
        pending = self._sends.pop(req_id, None)
        if (
            pending is None
            # Aborted or failed: its KV is not sent.
            or request.get_finished_reason() not in _SENT_FINISH_REASONS
            or (payload := self._payload(req_id, pending)) is None
        ):
            return
        self.stats.sent += 1
        data = payload.to_bytes()
        self._to_send[req_id] = data
        if kv_transfer_params is not None:
            kv_transfer_params[KV_TRANSFER_PARAMS_KEY] = base64.b64encode(data).decode(
                "ascii"
            )

    def take_kv_checksums_to_send(self) -> dict[str, bytes]:
        """The checksums of producer requests finished since the last call,
        for connectors that send them in their own messages."""
        to_send, self._to_send = self._to_send, {}
        return to_send

    def _blocks(
        self, blocks: KVCacheBlocks, start_token: int, end_token: int
    ) -> tuple[KVChecksumBlocks, frozenset[int]]:
        """The blocks of each transfer group holding tokens in
        ``[start_token, end_token)``, and the groups left out for a gap.

        Leading null blocks (out of a sliding window) are left out, as is a
        group with a null block after a non-null one (a gap). Sliding-window
        groups keep only the blocks P/D connectors transfer
        (``sliding_window_transfer_blocks``).

        A Mamba group's state is not per token: its block is the request's
        running-state slot, the one connectors transfer, at position 0.
        """
        groups: dict[int, tuple[int, list[int]]] = {}
        gaps: set[int] = set()
        for group_id, group in self._groups.items():
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                block_ids = [
                    b.block_id for b in blocks.blocks[group_id] if not b.is_null
                ]
                if block_ids:
                    state = clip_ssm_state_blocks(
                        block_ids, spec.num_speculative_blocks
                    )
                    groups[group_id] = (0, state)
                continue
            block_size = spec.block_size
            first = start_token // block_size
            try:
                run = _non_null_run(
                    blocks.blocks[group_id], first, cdiv(end_token, block_size)
                )
            except ValueError:
                gaps.add(group_id)
                continue
            if run is None:
                continue
            start, block_ids = run
            if keep := sliding_window_transfer_blocks(spec):
                start += max(0, len(block_ids) - keep)
                block_ids = block_ids[-keep:]
            groups[group_id] = (start, block_ids)
        return KVChecksumBlocks(num_tokens=end_token, groups=groups), frozenset(gaps)

    def _payload(self, req_id: str, pending: _Pending) -> KVChecksumPayload | None:
        """The sum of every worker's checksums, or None if some are missing."""
        try:
            pending.check_complete(self._num_workers)
            skipped = pending.skipped_groups()
            groups: dict[int, tuple[int, int, int, np.ndarray]] = {}
            for group_id, (start, block_ids) in pending.blocks.groups.items():
                if group_id in skipped:
                    continue
                span, per_block = self._spans[group_id]
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
        except _Unverified as e:
            self.stats.not_sent[e.reason] += 1
            warning_once(logger, "KV checksums not sent: %s.", e.reason)
            logger.debug("KV checksums of request %s not sent: %s", req_id, e.detail)
            return None
        except Exception:
            # Never out of the engine's scheduler: the consumer finds none.
            logger.exception("KV checksums of request %s not sent.", req_id)
            self.stats.not_sent[UnverifiedReason.INTERNAL] += 1
            return None
        return KVChecksumPayload(self._tp_size, pending.blocks.num_tokens, groups)

    def _verify(self, req_id: str, pending: _Pending) -> _Comparison | None:
        """Compare a finished load with its expected checksums, log and count
        the outcome.

        Returns:
            None if the load verified (or, for offloaded KV, had no
            checksummed group to compare), else the comparison that fails it:
            mismatching block positions per group, or (none) why it could not
            be compared.

        """
        comparison = self._compare(pending)
        mismatches, unverified, num_compared = comparison
        if mismatches:
            self.stats.mismatch += 1
            logger.error(
                "KV checksum mismatch for request %s: %s%s.",
                req_id,
                "; ".join(
                    f"group {group_id} block positions {positions}"
                    for group_id, positions in mismatches.items()
                ),
                "" if self._fail_closed else " (fail-open: the load is used)",
            )
        elif unverified:
            for reason in dict.fromkeys(e.reason for e in unverified):
                self.stats.unverified[reason] += 1
                warning_once(logger, "KV checksums not verified: %s.", reason)
            logger.debug(
                "KV checksums of request %s not verified: %s.",
                req_id,
                "; ".join(f"{e.reason} ({e.detail})" for e in unverified),
            )
        else:
            if num_compared:
                self.stats.verified += 1
                logger.debug("KV checksums of request %s verified.", req_id)
            return None
        return comparison

    def _compare(self, pending: _Pending) -> _Comparison:
        """The mismatching block positions per group, why the load or some of
        its groups could not be compared, and how many groups were."""
        try:
            pending.check_complete(self._num_workers)
            if pending.offload_request is None and pending.expected is None:
                raise _Unverified(pending.missing_reason)
        except _Unverified as e:
            return _Comparison({}, [e], 0)
        mismatches: dict[int, list[int]] = {}
        unverified: list[_Unverified] = []
        skipped = pending.skipped_groups()
        num_compared = 0
        for group_id in sorted(pending.gaps):
            unverified.append(_Unverified(UnverifiedReason.GAP, f"group {group_id}"))
        for group_id in pending.blocks.groups:
            try:
                if pending.offload_request is not None:
                    bad = self._compare_stored(pending, group_id)
                else:
                    assert pending.expected is not None
                    bad = self._compare_group(
                        pending, pending.expected, group_id, group_id in skipped
                    )
            except _Unverified as e:
                unverified.append(e)
                continue
            if bad is None:
                continue
            num_compared += 1
            if bad:
                mismatches[group_id] = bad
        # Checksums are offloaded only for the groups the workers can
        # checksum, fixed at startup, so a load of none of them is not checked.
        if not num_compared and not unverified and pending.offload_request is None:
            unverified.append(_Unverified(UnverifiedReason.NOTHING_CHECKSUMMED))
        return _Comparison(mismatches, unverified, num_compared)

    def _compare_group(
        self,
        pending: _Pending,
        expected: KVChecksumPayload,
        group_id: int,
        skipped: bool,
    ) -> list[int] | None:
        """The group's mismatching block positions, or None if the group is
        not compared (no worker of either side holds layers of it).

        Compared per span (``checksum_spans``); with different spans, sums of
        the smaller ones are compared with the larger ones. Without a
        mismatch, the group verifies only if every token the load must
        provide was compared (:meth:`_check_covered`).

        Raises:
            _Unverified: If the group cannot be compared.

        """
        spec = self._groups[group_id].kv_cache_spec
        if (
            isinstance(spec, MambaSpec)
            and spec.state_splits is None
            and not spec.tp_replicated
            and expected.tp_size != self._tp_size
        ):
            # Without its TP splits, a rank's share of sharded state depends on
            # the TP size.
            raise _Unverified(
                UnverifiedReason.MAMBA_TP,
                f"group {group_id}: producer TP {expected.tp_size}, "
                f"consumer TP {self._tp_size}",
            )
        span, per_block = self._spans[group_id]
        sent = expected.groups.get(group_id)
        checksums = [] if skipped else pending.group_checksums(group_id, per_block)
        # No worker checksums a group of only drafter layers, as if skipped.
        unchecked = not checksums
        if unchecked or sent is None:
            if unchecked != (sent is None):
                raise _Unverified(
                    UnverifiedReason.ONE_SIDE,
                    f"group {group_id} on the "
                    f"{'producer' if unchecked else 'consumer'} only",
                )
            if skipped:
                # Loaded, never compared: not verified.
                raise _Unverified(UnverifiedReason.SKIPPED, f"group {group_id}")
            return None
        # The payload's "block size" and start are in spans.
        fingerprint, sent_span, sent_start, sent_values = sent
        if fingerprint != pending.fingerprint(group_id):
            raise _Unverified(UnverifiedReason.OTHER_LAYERS, f"group {group_id}")
        start, block_ids = pending.blocks.groups[group_id]
        if isinstance(spec, MambaSpec):
            # One state, not tokens: whatever a producer calls its span.
            sent_span = 1
        chunk_size = max(span, sent_span)
        if chunk_size % min(span, sent_span):
            raise _Unverified(
                UnverifiedReason.BLOCK_SIZES,
                f"group {group_id}: checksums of {sent_span} tokens on the "
                f"producer, {span} on the consumer",
            )
        spans_per_chunk = chunk_size // span
        num_tokens = pending.blocks.num_tokens
        sent_first, sent_sums = _chunk_sums(
            sent_values, sent_start, sent_span, chunk_size, expected.num_tokens
        )
        checks = [
            _chunk_sums(values, start * per_block, span, chunk_size, num_tokens)
            for values in _sum_replicas(checksums, len(block_ids) * per_block)
        ]
        first, num_chunks = checks[0][0], len(checks[0][1])
        chunks = _common_chunks(
            (first, first + num_chunks),
            (sent_first, sent_first + len(sent_sums)),
            # A state has no tokens; only a last chunk can hold fewer on one side.
            None if isinstance(spec, MambaSpec) else chunk_size,
            num_tokens,
            expected.num_tokens,
        )
        bad = np.zeros(len(chunks), dtype=bool)
        if len(chunks) and chunks[-1] - chunks[0] == len(chunks) - 1:
            # Consecutive (the usual case): compared as slices.
            lo, hi = int(chunks[0]), int(chunks[-1]) + 1
            for _, sums in checks:
                bad |= (
                    sums[lo - first : hi - first]
                    != sent_sums[lo - sent_first : hi - sent_first]
                )
        else:
            for _, sums in checks:
                bad |= sums[chunks - first] != sent_sums[chunks - sent_first]
        if not bad.any():
            self._check_covered(pending, group_id, chunks, chunk_size)
            return []
        end = start + len(block_ids)
        # The consumer's blocks holding a bad chunk's spans.
        return sorted(
            {
                pos
                for chunk in chunks[bad].tolist()
                for pos in range(
                    max(start, chunk * spans_per_chunk // per_block),
                    min(end, cdiv((chunk + 1) * spans_per_chunk, per_block)),
                )
            }
        )

    def _check_covered(
        self, pending: _Pending, group_id: int, chunks: np.ndarray, chunk_size: int
    ) -> None:
        """Check that the compared ``chunks`` (ascending, of ``chunk_size``
        tokens) cover every token of the group the load must provide: those
        from its first loaded token; for a sliding-window group only the
        window the request reads from (the consumer's first kept block can
        start before what its producer kept, and the transfer writes no KV
        there); for a state group the state.

        Raises:
            _Unverified: If some are not compared, naming them.

        """
        spec = self._groups[group_id].kv_cache_spec
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
        if lo >= hi:
            return
        # ``chunks`` is ascending without repeats: all of [lo, hi) are in it
        # iff that many of it are.
        if len(chunks) and chunks[-1] - chunks[0] == len(chunks) - 1:
            if chunks[0] <= lo and hi <= chunks[-1] + 1:
                return
        else:
            within = np.searchsorted(chunks, [lo, hi])
            if within[1] - within[0] == hi - lo:
                return
        if isinstance(spec, MambaSpec):
            where = "the state"
        else:
            missing = np.setdiff1d(np.arange(lo, hi), chunks, assume_unique=True)
            where = "tokens " + _token_ranges(missing, chunk_size, lo_token, hi_token)
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
        raise _Unverified(reason, f"group {group_id}: {where}")

    def _compare_stored(self, pending: _Pending, group_id: int) -> list[int] | None:
        """The mismatching block positions in a group of a load of offloaded
        KV: each worker's checksums against those offloaded with the KV it
        loaded, untagged with the ``block_checksum_tags`` of the blocks the
        request expects there. None if no worker checksums the group, e.g.
        because none are offloaded for it.

        Raises:
            _Unverified: If a worker checksummed other blocks than scheduled,
                or a compared block has no stored value or block hash.

        """
        _, per_block = self._spans[group_id]
        if not pending.group_checksums(group_id, per_block):
            return None
        assert pending.offload_request is not None
        block_size = self._groups[group_id].kv_cache_spec.block_size
        hashes_per_block = block_size // (self._hash_block_size or block_size)
        request_hashes = pending.offload_request.block_hashes
        start, block_ids = pending.blocks.groups[group_id]
        ends = [
            (pos + 1) * hashes_per_block for pos in range(start, start + len(block_ids))
        ]
        if hashes_per_block < 1 or ends[-1] > len(request_hashes):
            raise _Unverified(
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
                raise _Unverified(
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


def _chunk_sums(
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


def _token_ranges(
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


def _common_chunks(
    chunks: tuple[int, int],
    sent_chunks: tuple[int, int],
    chunk_size: int | None,
    num_tokens: int,
    sent_num_tokens: int,
) -> np.ndarray:
    """The chunks in both ranges ``[first, end)`` that hold as many tokens on
    both sides (all of them if ``chunk_size`` is None), ascending."""
    lo = max(chunks[0], sent_chunks[0])
    hi = min(chunks[1], sent_chunks[1])
    if lo >= hi:
        return np.zeros(0, dtype=np.int64)
    if chunk_size is None:
        return np.arange(lo, hi)
    # Chunks below ``split`` are full on both sides; only the few after it
    # are counted one by one.
    split = min(max(lo, min(num_tokens, sent_num_tokens) // chunk_size), hi)
    tail = [
        chunk
        for chunk in range(split, hi)
        if num_valid_tokens(chunk, chunk_size, num_tokens)
        == num_valid_tokens(chunk, chunk_size, sent_num_tokens)
    ]
    if len(tail) == hi - split:
        return np.arange(lo, hi)
    return np.concatenate([np.arange(lo, split), np.array(tail, dtype=np.int64)])


def _non_null_run(
    blocks: Sequence[Block], first: int, end: int
) -> tuple[int, list[int]] | None:
    """The position and ids of the non-null blocks in ``blocks[first:end]``,
    if any.

    Raises:
        ValueError: If a null block follows a non-null one.

    """
    run = blocks[first:end]
    block_ids = [block.block_id for block in run if not block.is_null]
    if len(block_ids) == len(run):
        return (first, block_ids) if block_ids else None
    block_ids = []
    offset = 0
    for block in run:
        if not block.is_null:
            block_ids.append(block.block_id)
        elif block_ids:
            raise ValueError("a null block after a non-null one")
        else:
            offset += 1
    return (first + offset, block_ids) if block_ids else None


def _sum_replicas(
    groups: list[KVChecksumGroup], num_positions: int
) -> list[np.ndarray]:
    """The consumer's checksums of a group, one per check. Check ``k`` sums
    copy ``k % R`` of each layer replicated on ``R`` ranks, so every check
    covers each layer once and every copy is checked.

    Raises:
        _Unverified: If a check misses a copy.

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
                raise _Unverified(
                    UnverifiedReason.MISSING_REPLICA,
                    f"replica {k % replicas} of {replicas}",
                )
            check += copy
        checks.append(check)
    return checks
