"""Scheduler-side KV checksums: the blocks workers checksum, their records
collected per request, and what is done with each verdict; the comparison
itself is :mod:`engine_patch.verify`.

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

from collections.abc import Sequence
from typing import Any, cast

from engine_patch.config import KVChecksumConfig
from engine_patch.host import (
    KV_SENT_FINISH_REASONS,
    NULL_BLOCK_ID,
    Block,
    BlockIds,
    CacheHitSource,
    KVCacheBlocks,
    KVCacheManager,
    KVChecksumConnector,
    KVConnectorOutput,
    Request,
)
from engine_patch.kv_cache import (
    KVCacheConfig,
    MambaSpec,
    cdiv,
    clip_ssm_state_blocks,
    sliding_window_transfer_blocks,
)
from engine_patch.log import get_logger, warning_once
from engine_patch.payload import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumPayload,
    decode_base64,
    encode_base64,
)
from engine_patch.records import checksums_problem, record_problem, requests_named
from engine_patch.stats import KVChecksumStats
from engine_patch.types import KVChecksumBlocks, KVChecksumRecord, KVChecksumScheduled
from engine_patch.verify import (
    KV_CHECKSUM_FAILURE_TEXT,
    Comparison,
    KVChecksumComparer,
    PendingChecksums,
    Unverified,
    UnverifiedReason,
)

__all__ = ["KV_CHECKSUM_FAILURE_TEXT", "KVChecksumScheduler", "UnverifiedReason"]

logger = get_logger(__name__)

# No group left out for a gap: one shared set, not a new one (tracked by the
# cyclic collector) kept by every pending load.
_NO_GAPS: frozenset[int] = frozenset()


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
        self._fail_closed = config.fail_closed
        self._comparer = KVChecksumComparer(config, kv_cache_config)
        self._groups = self._comparer.groups
        self._sends: dict[str, PendingChecksums] = {}
        self._recvs: dict[str, PendingChecksums] = {}
        # Consumer requests whose KV load has not started yet.
        self._remote_prefills: set[str] = set()
        # Consumer requests whose load was refused (on_unverifiable_load).
        self._refused_loads: set[str] = set()
        self._to_send: dict[str, bytes] = {}
        self._failures: dict[str, str] = {}
        self._mismatched: dict[str, dict[int, list[int]]] = {}
        self._uncompared: dict[str, list[tuple[int, int]]] = {}
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

    def expects_load(self, request: Request) -> bool:
        """Whether ``request`` is a consumer whose load from its producer has
        not started: the load :meth:`add_recv` checksums."""
        return request.request_id in self._remote_prefills

    def on_unverifiable_load(self, request: Request, reason: UnverifiedReason) -> bool:
        """Note that a consumer request's coming load from its producer cannot
        be checksummed (e.g. ``SYNC_LOAD``: its connector loads it inside the
        forward that uses it, before any verdict): counted unverified.

        Returns:
            Whether the load must not happen (fail-closed): the host then
            computes the request's prompt itself. False for fail-open, and
            for a request that is not such a consumer (its load is not one
            KVGuard checks).

        """
        req_id = request.request_id
        if req_id in self._refused_loads:
            return True  # Asked again (the request waited for blocks).
        if req_id not in self._remote_prefills:
            return False
        self._remote_prefills.discard(req_id)
        self.stats.unverified[reason] += 1
        warning_once(
            logger,
            "KV loads not verified: %s%s.",
            reason,
            " (fail-closed: such loads are refused and their prompts computed locally)"
            if self._fail_closed
            else " (fail-open: such loads are used unchecked)",
        )
        if self._fail_closed:
            self._refused_loads.add(req_id)
        return self._fail_closed

    def add_send(
        self,
        request: Request,
        num_scheduled_tokens: int,
        kv_cache_manager: KVCacheManager,
        block_ids: BlockIds | None = None,
    ) -> None:
        """Checksum a producer request's KV if this step, which schedules
        ``num_scheduled_tokens`` of it, finishes its prompt, for its consumer
        to verify after loading it.

        ``request.num_computed_tokens`` must already include this step's
        tokens. ``block_ids``, where the host has the request's at hand (a
        new request's in vLLM's scheduler output), are read instead of
        ``kv_cache_manager``'s blocks: no Python object per block.
        """
        num_tokens = request.num_computed_tokens
        num_prompt_tokens = request.num_prompt_tokens
        if not num_tokens - num_scheduled_tokens < num_prompt_tokens <= num_tokens:
            return
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return
        checksum_blocks, _ = self._blocks(
            block_ids
            if block_ids is not None
            else kv_cache_manager.get_blocks(request.request_id).blocks,
            0,
            num_tokens,
        )
        # A new prefill (after a preemption) replaces an earlier one.
        self._sends[request.request_id] = PendingChecksums(checksum_blocks)
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
        (``KVChecksumConnector.get_kv_checksum_sources``). A consumer's load
        that comes partly from its producer and partly from another tier is
        unverified when it finishes (``MIXED_SOURCES``).

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
                    blocks.blocks,
                    num_local_computed_tokens,
                    request.num_computed_tokens,
                )
                self._recvs[req_id] = PendingChecksums(
                    checksum_blocks,
                    num_local_computed_tokens,
                    gaps,
                    offload_request=request,
                )
                self._scheduled.reqs_to_load[req_id] = checksum_blocks
            return
        if sources != {CacheHitSource.P2P}:
            if CacheHitSource.P2P in sources:
                # Partly from the producer, partly from a cache tier of the
                # engine's own: the producer's tokens are not known apart.
                self._recvs[req_id] = PendingChecksums(
                    KVChecksumBlocks(request.num_computed_tokens, {}),
                    num_local_computed_tokens,
                    unverifiable=UnverifiedReason.MIXED_SOURCES,
                )
            return
        checksum_blocks, gaps = self._blocks(
            blocks.blocks,
            num_local_computed_tokens,
            request.num_computed_tokens,
        )
        pending = PendingChecksums(checksum_blocks, num_local_computed_tokens, gaps)
        params = request.kv_transfer_params or {}
        if (encoded := params.get(KV_TRANSFER_PARAMS_KEY)) is not None:
            # Not base64 text: b"", not a payload either.
            self._set_expected(req_id, pending, decode_base64(encoded))
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
                outcome = Comparison({}, [Unverified(UnverifiedReason.INTERNAL)], 0, {})
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

    def take_uncompared_blocks(self) -> dict[str, list[tuple[int, int]]]:
        """Loads compared since the last call whose blocks hold loaded
        tokens that were not compared: request id -> the token ranges
        ``[start, end)`` of those blocks.

        Only sliding-window groups have them, in loads that verify: the
        consumer's first kept block can start before what its producer
        kept, and the transfer wrote nothing there. The request never reads
        those tokens (they are outside its window), but another request
        whose window holds them would: the host must never let another
        request reuse these blocks.
        """
        uncompared, self._uncompared = self._uncompared, {}
        return uncompared

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
                self._set_expected(req_id, pending, data)

    @staticmethod
    def _set_expected(req_id: str, pending: PendingChecksums, data: object) -> None:
        """Give a load the producer's payload; a malformed one leaves it
        unverified."""
        if (problem := pending.set_expected(data)) is not None:
            logger.debug("Invalid KV checksums for request %s: %s", req_id, problem)

    def _pending(self, req_id: str) -> PendingChecksums | None:
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
        self._refused_loads.discard(req_id)
        self._recvs.pop(req_id, None)
        pending = self._sends.pop(req_id, None)
        if (
            pending is None
            # Aborted or failed: its KV is not sent.
            or request.get_finished_reason() not in KV_SENT_FINISH_REASONS
            or (payload := self._payload(req_id, pending)) is None
        ):
            return
        self.stats.sent += 1
        data = payload.to_bytes()
        self._to_send[req_id] = data
        if kv_transfer_params is not None:
            kv_transfer_params[KV_TRANSFER_PARAMS_KEY] = encode_base64(data)

    def take_kv_checksums_to_send(self) -> dict[str, bytes]:
        """The checksums of producer requests finished since the last call,
        for connectors that send them in their own messages.

        Hosts whose checksums travel only in ``kv_transfer_params`` call it
        too, and drop them: the scheduler keeps them until taken.
        """
        to_send, self._to_send = self._to_send, {}
        return to_send

    def held_request_ids(self) -> set[str]:
        """The requests the scheduler holds anything of: unfinished ones, and
        finished ones whose outcomes the host has not taken (``take_*``).

        Empty once every request has finished and the host has taken the
        outcomes: a long-running engine holds nothing of past requests.
        """
        return {
            *self._sends,
            *self._recvs,
            *self._remote_prefills,
            *self._refused_loads,
            *self._to_send,
            *self._failures,
            *self._mismatched,
            *self._uncompared,
        }

    def _blocks(
        self,
        blocks: Sequence[Sequence[Block]] | BlockIds,
        start_token: int,
        end_token: int,
    ) -> tuple[KVChecksumBlocks, frozenset[int]]:
        """The blocks of each transfer group holding tokens in
        ``[start_token, end_token)``, and the groups left out for a gap;
        ``blocks`` per group, as blocks or as a host's ids.

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
                ids = _ids_of(blocks[group_id], 0, None)
                if block_ids := [i for i in ids if i != NULL_BLOCK_ID]:
                    state = clip_ssm_state_blocks(
                        block_ids, spec.num_speculative_blocks
                    )
                    groups[group_id] = (0, state)
                continue
            block_size = spec.block_size
            first = start_token // block_size
            ids = _ids_of(blocks[group_id], first, cdiv(end_token, block_size))
            try:
                run = _non_null_run(ids, first)
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
        return KVChecksumBlocks(num_tokens=end_token, groups=groups), (
            frozenset(gaps) if gaps else _NO_GAPS
        )

    def _payload(
        self, req_id: str, pending: PendingChecksums
    ) -> KVChecksumPayload | None:
        """The sum of every worker's checksums, or None if some are missing."""
        try:
            return self._comparer.payload(pending)
        except Unverified as e:
            self.stats.not_sent[e.reason] += 1
            warning_once(logger, "KV checksums not sent: %s.", e.reason)
            logger.debug("KV checksums of request %s not sent: %s", req_id, e.detail)
            return None
        except Exception:
            # Never out of the engine's scheduler: the consumer finds none.
            logger.exception("KV checksums of request %s not sent.", req_id)
            self.stats.not_sent[UnverifiedReason.INTERNAL] += 1
            return None

    def _verify(self, req_id: str, pending: PendingChecksums) -> Comparison | None:
        """Compare a finished load with its expected checksums, log and count
        the outcome.

        Returns:
            None if the load verified (or, for offloaded KV, had no
            checksummed group to compare), else the comparison that fails it:
            mismatching block positions per group, or (none) why it could not
            be compared.

        """
        comparison = self._comparer.compare(pending)
        mismatches, unverified, num_compared, uncompared = comparison
        if uncompared:
            ranges = self._uncompared.setdefault(req_id, [])
            for group_id, positions in uncompared.items():
                block_size = self._comparer.block_size(group_id)
                ranges.extend((p * block_size, (p + 1) * block_size) for p in positions)
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


def _ids_of(
    blocks: Sequence[Block] | Sequence[int], start: int, end: int | None
) -> list[int]:
    """The ids of ``blocks[start:end]``, a new list; a host's ids as they
    are. The null block's id is ``NULL_BLOCK_ID`` (``Block``), so no block's
    ``is_null`` is read: one attribute per block, as vLLM lists them for its
    workers."""
    if not blocks or isinstance(blocks[0], int):
        ids = cast("Sequence[int]", blocks)[start:end]
        return ids if isinstance(ids, list) else list(ids)
    whole = start == 0 and (end is None or end >= len(blocks))
    # All of a request's blocks (a load without a local prefix): read in
    # place, not sliced into a list first.
    part = cast("Sequence[Block]", blocks if whole else blocks[start:end])
    return [b.block_id for b in part]


def _non_null_run(ids: list[int], first: int) -> tuple[int, list[int]] | None:
    """The position and ids of the non-null blocks of ``ids`` (block ids
    from position ``first`` on), if any.

    Raises:
        ValueError: If a null block follows a non-null one.

    """
    # Ids are not negative: all() is "no null block", without a comparison
    # per id.
    if all(ids):
        return (first, ids) if ids else None
    offset = 0
    while offset < len(ids) and ids[offset] == NULL_BLOCK_ID:
        offset += 1
    if not all(ids[offset:]):
        raise ValueError("a null block after a non-null one")
    return (first + offset, ids[offset:]) if offset < len(ids) else None
