"""KVGuard in vLLM's scheduler process: drives engine_patch's
:class:`~engine_patch.scheduler.KVChecksumScheduler` from the connector
calls vLLM makes, around the inner connector's.

vLLM 0.32's ``Scheduler.update_from_output`` handles failed loads first,
then calls a finished request's ``request_finished*``, and only then
``update_connector_output`` with the step's worker results. So:

- a producer's checksums, computed in the step that finishes its prompt,
  arrive after ``request_finished``: the request's ``kv_transfer_params``
  dict is kept and filled in ``update_connector_output`` (same call, before
  the step's outputs leave the engine);
- a consumer's finished load is checksummed by the workers before any later
  step can write its blocks. With KVGuard's scheduler class
  (:mod:`engine_patch.vllm.scheduler`) it is verified at the start of the
  ``update_from_output`` that reports it, and a failed verification joins
  the step's ``failed_recving`` before vLLM reads it (same-step verdicts).
  Connector-only, a fail-closed load is held back from vLLM by the workers
  until the scheduler has verified it and sent its verdict in a later
  step's metadata (one engine step), and a failed verification then
  reaches vLLM as a failed load. vLLM applies its
  ``kv_load_failure_policy`` either way. Fail-open holds nothing: the
  outcome is counted and logged, and a mismatched load's request decodes
  but its blocks are kept out of vLLM's prefix cache
  (:mod:`engine_patch.vllm.prefix_cache`).

Steps with nothing of KVGuard's pending (most of them: a producer's engine
steps idly while NIXL holds finished requests' blocks) cost a few attribute
checks; only the calls that do work are timed into ``scheduler_seconds``.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from engine_patch.host import NULL_BLOCK_ID
from engine_patch.log import get_logger
from engine_patch.scheduler import KVChecksumScheduler, UnverifiedReason
from engine_patch.stats import KVChecksumStats
from engine_patch.types import KVChecksumRecord
from engine_patch.vllm.host import (
    ConnectorHooks,
    RequestAt,
    UnsupportedKVCacheError,
    convert_kv_cache_config,
)
from engine_patch.vllm.metadata import KVGuardWorkerMetadata
from engine_patch.vllm.prefill_ids import PrefillBlockIds, StepBlockIds
from engine_patch.vllm.prefix_cache import (
    keep_blocks_out_of_prefix_cache,
    keep_out_of_prefix_cache,
)
from engine_patch.vllm.stats import Snapshot, checksum_deltas

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from engine_patch.types import KVChecksumScheduled
    from engine_patch.vllm.config import KVGuardSettings

logger = get_logger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass
class _StepOutput:
    """A step's connector output as the checksum scheduler reads it
    (``engine_patch.host.KVConnectorOutput``)."""

    kv_checksums: Sequence[KVChecksumRecord]
    finished_recving: Collection[str]


@dataclass
class _Finished:
    """A finished request whose checksums are sent once the step's worker
    results are in."""

    request: Request
    kv_transfer_params: dict[str, Any] | None
    # Whether it may send checksums (a producer request): only then can
    # sending it change the outcome counts.
    producer: bool


@dataclass
class _Loads:
    """Connector-only mode: finished loads the workers hold back, by request
    id."""

    # Workers that reported the load checksummed.
    reported: Counter[str] = field(default_factory=Counter)
    # Verdicts for the workers' next metadata: whether the load failed.
    verdicts: dict[str, bool] = field(default_factory=dict)
    # Loads a worker's inner connector failed, until every worker reported.
    failed_by_a_worker: set[str] = field(default_factory=set)


def _timed(
    method: Callable[Concatenate[KVGuardSchedulerSide, _P], _T],
) -> Callable[Concatenate[KVGuardSchedulerSide, _P], _T]:
    """Add the method's time to the scheduler's own (its overhead)."""

    def timed(self: KVGuardSchedulerSide, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - start

    functools.update_wrapper(timed, method)
    return timed


class KVGuardSchedulerSide:
    """The scheduler-side checksum logic of one engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        inner: KVConnectorBase_V1,
        settings: KVGuardSettings,
    ) -> None:
        config = settings.checksum_config(vllm_config)
        self._num_workers = config.tp_size * config.pp_size
        self._checksums = KVChecksumScheduler.create(
            config,
            convert_kv_cache_config(
                kv_cache_config, fail_closed=config.fail_closed, vllm_config=vllm_config
            ),
            ConnectorHooks(inner),
        )
        self._kv_cache_manager: KVCacheManager | None = None
        # Whether KVGuard's scheduler class verifies loads (same-step verdicts).
        self._same_step = False
        # The step output the scheduler class verified, which
        # update_connector_output then brings again: not verified twice.
        self._verified: KVConnectorOutput | None = None
        # Producer requests that may send KV, by id.
        self._producers: dict[str, Request] = {}
        # Their block ids over the steps of a chunked prefill.
        self._prefill_ids = PrefillBlockIds(kv_cache_config)
        # Per request: the locally computed tokens its connector lookup saw.
        self._num_local_tokens: dict[str, int] = {}
        # Loads not verified yet, by id: the request and its first loaded
        # token (a fail-open mismatch keeps its blocks out of the prefix
        # cache; a verified load's blocks holding tokens not compared too).
        self._loading: dict[str, tuple[Request, int]] = {}
        # Whether a load started since the last metadata (its blocks go to
        # the workers in the next one).
        self._loads_started = False
        self._finished: list[_Finished] = []
        self._loads = _Loads()
        # Loads failed since the last stats, with their error messages.
        self._failed_loads: dict[str, str] = {}
        self._reported = Snapshot()
        # Whether outcomes may have changed since the last stats.
        self._outcomes = False
        # Time in KVGuard's scheduler-side code since the last stats.
        self._seconds = 0.0
        # Consumer loads the inner connector makes synchronously, inside the
        # forward of the step that schedules them: verified in that step's
        # update_from_output by the scheduler class, where vLLM takes a failed
        # one as invalid blocks (a single KV cache group only). Requests
        # allowed one, and loads started since the last metadata.
        self._sync_allowed: set[str] = set()
        self._sync_started: list[str] = []
        groups = kv_cache_config.kv_cache_groups
        self._sync_block_size = (
            groups[0].kv_cache_spec.block_size if len(groups) == 1 else None
        )

    @property
    def enabled(self) -> bool:
        return self._checksums is not None

    @property
    def stats(self) -> KVChecksumStats:
        """Outcomes since start."""
        return self._checksums.stats if self._checksums else KVChecksumStats()

    @property
    def same_step(self) -> bool:
        """Whether KVGuard's scheduler class verifies the loads."""
        return self._same_step

    @property
    def hold_loads(self) -> bool:
        """Whether the workers hold finished loads until their verdicts:
        fail-closed without KVGuard's scheduler class."""
        return (
            self._checksums is not None
            and self._checksums.fail_closed
            and not self._same_step
        )

    def use_same_step_verdicts(self) -> None:
        """KVGuard's scheduler class verifies each step's finished loads
        (:meth:`verify_finished_loads`): the workers hold none."""
        self._same_step = True

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Keep the engine's KV cache manager (a producer's blocks).

        Raises:
            UnsupportedKVCacheError: If vLLM's null block is not id
                ``NULL_BLOCK_ID``: block ids are read as vLLM lists them for
                its workers, the null block by its id.
        """
        null_id = kv_cache_manager.block_pool.null_block.block_id
        if self._checksums is not None and null_id != NULL_BLOCK_ID:
            raise UnsupportedKVCacheError(
                f"vLLM's null block is block {null_id}, not {NULL_BLOCK_ID}"
            )
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        """Before the inner connector sees it (NIXL clears a consumer's
        ``do_remote_prefill`` once its load starts)."""
        if self._checksums is not None and request.kv_transfer_params:
            self._on_new_request(request)

    @_timed
    def _on_new_request(self, request: Request) -> None:
        assert self._checksums is not None
        self._checksums.on_new_request(request)
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._producers[request.request_id] = request

    def on_matched_tokens(self, request: Request, num_computed_tokens: int) -> None:
        """The locally computed tokens the connector's lookup was given: the
        start of a load that follows."""
        if self._checksums is not None:
            self._num_local_tokens[request.request_id] = num_computed_tokens

    def refuses_sync_load(self, request: Request) -> bool:
        """Whether a load the inner connector would make synchronously
        (inside the forward that uses the KV) must not happen.

        With KVGuard's scheduler class and one KV cache group, a consumer's
        such load from its producer goes ahead and is verified in the
        ``update_from_output`` of its step, a failed one becoming invalid
        blocks, which vLLM recomputes or fails by ``kv_load_failure_policy``
        before the step's token is used. Otherwise no verdict can count: it
        is counted unverified, and refused fail-closed.
        """
        if self._checksums is None:
            return False
        if (
            self._same_step
            and self._sync_block_size is not None
            and self._checksums.expects_load(request)
        ):
            self._sync_allowed.add(request.request_id)
            return False
        self._outcomes = True
        return self._checksums.on_unverifiable_load(request, UnverifiedReason.SYNC_LOAD)

    def on_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """After the inner connector's ``update_state_after_alloc``: a load of
        ``num_external_tokens`` starts."""
        if self._checksums is not None and num_external_tokens > 0:
            self._on_alloc(request, blocks, num_external_tokens)

    @_timed
    def _on_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._checksums is not None
        num_local = self._num_local_tokens.get(request.request_id, 0)
        self._checksums.add_recv(
            RequestAt(request, num_local + num_external_tokens), blocks, num_local
        )
        self._loads_started = True
        self._loading[request.request_id] = (request, num_local)
        if request.request_id in self._sync_allowed:
            self._sync_allowed.discard(request.request_id)
            self._sync_started.append(request.request_id)

    def build_meta(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[KVChecksumScheduled | None, dict[str, bool], Sequence[str]]:
        """The step's checksums for the workers, the verdicts they wait for,
        and the loads the step's forward makes (``refuses_sync_load``).

        Runs before vLLM counts the step's tokens in ``num_computed_tokens``.
        """
        if self._checksums is None or not (
            self._producers or self._loads_started or self._loads.verdicts
        ):
            return None, {}, ()
        checksums, verdicts = self._build_meta(scheduler_output)
        sync, self._sync_started = self._sync_started, []
        return checksums, verdicts, sync

    @_timed
    def _build_meta(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[KVChecksumScheduled | None, dict[str, bool]]:
        assert self._checksums is not None and self._kv_cache_manager is not None
        scheduled = scheduler_output.num_scheduled_tokens
        step: StepBlockIds | None = None
        for req_id, request in self._producers.items():
            if not (num_tokens := scheduled.get(req_id)):
                continue
            computed = request.num_computed_tokens
            if computed >= request.num_prompt_tokens:
                # Decoding: its prompt's checksums are sent.
                continue
            if step is None:
                step = StepBlockIds(scheduler_output)
            # The request's blocks as vLLM lists them for its workers (the
            # null block is id 0), where known: read, not each block.
            if self._prefill_ids.enabled:
                block_ids = self._prefill_ids.step(
                    step, req_id, computed, num_tokens, request.num_prompt_tokens
                )
            else:
                block_ids = step.new(req_id)
            if computed + num_tokens >= request.num_prompt_tokens:
                # The step finishes the prompt.
                self._checksums.add_send(
                    RequestAt(request, computed + num_tokens),
                    num_tokens,
                    self._kv_cache_manager,
                    block_ids,
                )
        self._loads_started = False
        verdicts, self._loads.verdicts = self._loads.verdicts, {}
        return self._checksums.build_checksum_meta(), verdicts

    def on_request_finished(
        self, request: Request, kv_transfer_params: dict[str, Any] | None
    ) -> None:
        """After the inner connector's ``request_finished*``: the request's
        checksums go into ``kv_transfer_params`` once the step's results are
        in (:meth:`on_step_output`)."""
        if self._checksums is None:
            return
        producer = self._producers.pop(request.request_id, None) is not None
        self._prefill_ids.discard(request.request_id)
        self._num_local_tokens.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._sync_allowed.discard(request.request_id)
        self._finished.append(_Finished(request, kv_transfer_params, producer))

    def held_request_ids(self) -> set[str]:
        """The requests the scheduler side holds anything of, its checksum
        scheduler's included: unfinished ones, finished ones whose step
        output is not in yet, loads the workers wait on verdicts for.

        Empty once every request has finished and a step has passed: a
        long-running engine holds nothing of past requests. Outcome counts
        wait for the next stats (``take_stats``) and are not counted here.
        """
        if self._checksums is None:
            return set()
        return {
            *self._producers,
            *self._prefill_ids.held_request_ids(),
            *self._num_local_tokens,
            *self._loading,
            *self._sync_allowed,
            *self._sync_started,
            *(item.request.request_id for item in self._finished),
            *self._loads.reported,
            *self._loads.verdicts,
            *self._loads.failed_by_a_worker,
            *self._checksums.held_request_ids(),
        }

    def verify_finished_loads(
        self, output: KVConnectorOutput, sync_loads: Collection[str] = ()
    ) -> None:
        """Same-step verdicts (KVGuard's scheduler class, before vLLM reads
        the step's failed loads): verify the loads in ``finished_recving``
        and add each one that fails to ``failed_recving``, and the step's
        ``sync_loads`` (made in its forward), each failed one's loaded blocks
        to ``invalid_block_ids``; in place."""
        if self._checksums is None:
            return
        self._verified = output
        meta = output.kv_connector_worker_meta
        if (
            meta is not None
            or output.finished_recving
            or output.failed_recving
            or sync_loads
        ):
            assert meta is None or isinstance(meta, KVGuardWorkerMetadata)
            self._take_output(output, meta, sync_loads)

    def on_step_output(
        self, output: KVConnectorOutput, meta: KVGuardWorkerMetadata | None
    ) -> None:
        """Take the workers' checksums and verify the finished loads, unless
        :meth:`verify_finished_loads` did; send the checksums of the requests
        that finished."""
        if self._checksums is None:
            return
        if output is self._verified:
            self._verified = None
        elif meta is not None or output.failed_recving:
            self._take_output(output, meta)
        self.flush_finished()

    @_timed
    def _take_output(
        self,
        output: KVConnectorOutput,
        meta: KVGuardWorkerMetadata | None,
        sync_loads: Collection[str] = (),
    ) -> None:
        assert self._checksums is not None
        records: list[KVChecksumRecord] = []
        complete: set[str] = set()
        for report in meta.reports if meta is not None else ():
            if report.record is not None:
                records.append(report.record)
            if self._same_step:
                continue
            self._loads.failed_by_a_worker.update(report.failed_loads)
            for req_id in (*report.finished_loads, *report.failed_loads):
                self._loads.reported[req_id] += 1
                if self._loads.reported[req_id] >= self._num_workers:
                    del self._loads.reported[req_id]
                    complete.add(req_id)
        # vLLM already failed these: nothing to verify, the state is dropped.
        failed_by_inner = set(output.failed_recving or ())
        sync = set(sync_loads)
        if self._same_step:
            complete = set(output.finished_recving or ()) - failed_by_inner
            complete |= sync
        elif self._loads.failed_by_a_worker:
            # vLLM fails these once the workers holding them let them go: a
            # failed transfer, not KVGuard's failure.
            by_a_worker = complete & self._loads.failed_by_a_worker
            self._loads.failed_by_a_worker -= by_a_worker
            failed_by_inner |= by_a_worker
        self._checksums.update_from_output(
            _StepOutput(records, complete | failed_by_inner), failed_by_inner
        )
        self._outcomes = True
        failed = self._checksums.take_load_failures()
        invalid = [self._loaded_block_ids(r) for r in failed.keys() & sync]
        self._keep_out_of_prefix_cache(complete, failed.keys() | failed_by_inner, sync)
        if self._same_step:
            # Still in finished_recving: vLLM releases the request from its
            # wait and applies kv_load_failure_policy.
            output.failed_recving.update(failed.keys() - sync)
            # Loaded in this step's forward: vLLM drops the step's token and
            # recomputes or fails the request from its first invalid block.
            for block_ids in invalid:
                output.invalid_block_ids.update(block_ids)
        elif self._checksums.fail_closed:
            # The workers hold these loads until they hear.
            for req_id in complete:
                self._loads.verdicts[req_id] = (
                    req_id in failed or req_id in failed_by_inner
                )
        for req_id, message in sorted(failed.items()):
            self._failed_loads[req_id] = message
            logger.error("KVGuard fails the KV load (fail-closed). %s.", message)

    def _loaded_block_ids(self, req_id: str) -> list[int]:
        """The blocks a synchronous load wrote (one KV cache group): those
        from its first loaded token on."""
        assert self._kv_cache_manager is not None
        assert self._sync_block_size is not None
        load = self._loading.get(req_id)
        if load is None:
            return []
        _, first_loaded_token = load
        (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)
        return block_ids[first_loaded_token // self._sync_block_size :]

    def _keep_out_of_prefix_cache(
        self, verified: set[str], failed: set[str], sync: set[str]
    ) -> None:
        """No other request may reuse a fail-open load's mismatched KV, nor a
        load's blocks holding tokens that were not compared. Runs before vLLM
        caches the step's finished loads (in the next ``schedule``); vLLM
        never caches a ``failed`` load (it recomputes or fails it). A ``sync``
        load's blocks vLLM cached when it allocated them: they are evicted."""
        assert self._checksums is not None
        mismatched = self._checksums.take_mismatched_loads()
        uncompared = self._checksums.take_uncompared_blocks()
        if not self._loading:
            return
        for req_id in verified | failed:
            if (
                req_id in sync
                and req_id not in failed
                and (req_id in mismatched or req_id in uncompared)
            ):
                assert self._kv_cache_manager is not None
                self._kv_cache_manager.evict_blocks(set(self._loaded_block_ids(req_id)))
            load = self._loading.pop(req_id, None)
            if load is None or req_id in failed or req_id in sync:
                continue
            assert self._kv_cache_manager is not None
            request, first_loaded_token = load
            hash_block_size = self._kv_cache_manager.block_pool.hash_block_size
            if req_id in mismatched:
                keep_out_of_prefix_cache(request, first_loaded_token, hash_block_size)
            elif req_id in uncompared:
                keep_blocks_out_of_prefix_cache(
                    request, uncompared[req_id], hash_block_size
                )

    def flush_finished(self) -> None:
        """Send the checksums of the requests finished since the last call."""
        if self._finished:
            self._flush()

    @_timed
    def _flush(self) -> None:
        assert self._checksums is not None
        finished, self._finished = self._finished, []
        for item in finished:
            self._checksums.request_finished(item.request, item.kv_transfer_params)
            self._outcomes |= item.producer
        # For connectors that send checksums in their own messages; NIXL's
        # go in kv_transfer_params, filled above.
        self._checksums.take_kv_checksums_to_send()

    def take_stats(self) -> dict[str, Any] | None:
        """Outcome counts since the last call, or None if none changed."""
        if self._checksums is None or not self._outcomes:
            return None
        start = time.perf_counter()
        self._outcomes = False
        now = Snapshot.of(self._checksums.stats)
        if now == self._reported:
            # Nothing counted: the time waits for an outcome.
            self._seconds += time.perf_counter() - start
            return None
        counts = checksum_deltas(now, self._reported)
        self._reported = now
        counts["failed_loads"] = len(self._failed_loads)
        counts["failed_requests"], self._failed_loads = self._failed_loads, {}
        self._seconds += time.perf_counter() - start
        counts["scheduler_seconds"], self._seconds = self._seconds, 0.0
        return counts
