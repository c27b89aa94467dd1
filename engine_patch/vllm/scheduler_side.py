"""KVGuard in vLLM's scheduler process: drives engine_patch's
:class:`~engine_patch.scheduler.KVChecksumScheduler` from the connector
calls vLLM makes, around the inner connector's.

vLLM 0.32's ``Scheduler.update_from_output`` calls a finished request's
``request_finished*`` before ``update_connector_output`` brings the step's
worker results, and handles failed loads before either. So:

- a producer's checksums, computed in the step that finishes its prompt,
  arrive after ``request_finished``: the request's ``kv_transfer_params``
  dict is kept and filled in ``update_connector_output`` (same call, before
  the step's outputs leave the engine);
- a consumer's finished load is checksummed by the workers before any later
  step can write its blocks and, under fail-closed, held back from vLLM
  until the scheduler has verified it and sent its verdict in a later step's
  metadata; a failed verification then reaches vLLM as a failed load
  (``failed_recving``), which vLLM handles by its ``kv_load_failure_policy``.
  Fail-open holds nothing: the outcome is only counted and logged.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.stats import KVChecksumStats
from engine_patch.types import KVChecksumRecord
from engine_patch.vllm.host import ConnectorHooks, RequestAt, convert_kv_cache_config
from engine_patch.vllm.metadata import KVGuardWorkerMetadata
from engine_patch.vllm.stats import checksum_deltas, snapshot

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

logger = logging.getLogger(__name__)

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


@dataclass
class _Loads:
    """Finished loads the workers hold back, by request id."""

    # Workers that reported the load checksummed.
    reported: Counter[str] = field(default_factory=Counter)
    # Verdicts for the workers' next metadata: whether the load failed.
    verdicts: dict[str, bool] = field(default_factory=dict)


def _timed(
    method: Callable[Concatenate[KVGuardSchedulerSide, _P], _T],
) -> Callable[Concatenate[KVGuardSchedulerSide, _P], _T]:
    """Add the method's time to the scheduler's own (its overhead)."""

    @functools.wraps(method)
    def timed(self: KVGuardSchedulerSide, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - start

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
            convert_kv_cache_config(kv_cache_config, fail_closed=config.fail_closed),
            ConnectorHooks(inner),
        )
        self._kv_cache_manager: KVCacheManager | None = None
        # Producer requests that may send KV, by id.
        self._producers: dict[str, Request] = {}
        # Per request: the locally computed tokens its connector lookup saw.
        self._num_local_tokens: dict[str, int] = {}
        self._finished: list[_Finished] = []
        self._loads = _Loads()
        # Loads failed since the last stats, with their error messages.
        self._failed_loads: dict[str, str] = {}
        self._reported = snapshot(KVChecksumStats())
        # Time in KVGuard's scheduler-side code since the last stats.
        self._seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self._checksums is not None

    @property
    def stats(self) -> KVChecksumStats:
        """Outcomes since start."""
        return self._checksums.stats if self._checksums else KVChecksumStats()

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager

    @_timed
    def on_new_request(self, request: Request) -> None:
        """Before the inner connector sees it (NIXL clears a consumer's
        ``do_remote_prefill`` once its load starts)."""
        if self._checksums is None:
            return
        self._checksums.on_new_request(request)
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._producers[request.request_id] = request

    def on_matched_tokens(self, request: Request, num_computed_tokens: int) -> None:
        """The locally computed tokens the connector's lookup was given: the
        start of a load that follows."""
        if self._checksums is not None:
            self._num_local_tokens[request.request_id] = num_computed_tokens

    @_timed
    def on_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """After the inner connector's ``update_state_after_alloc``: a load of
        ``num_external_tokens`` starts."""
        if self._checksums is None or num_external_tokens <= 0:
            return
        num_local = self._num_local_tokens.get(request.request_id, 0)
        self._checksums.add_recv(
            RequestAt(request, num_local + num_external_tokens), blocks, num_local
        )

    @_timed
    def build_meta(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[KVChecksumScheduled | None, dict[str, bool]]:
        """The step's checksums for the workers, and the verdicts they wait for.

        Runs before vLLM counts the step's tokens in ``num_computed_tokens``.
        """
        if self._checksums is None:
            return None, {}
        assert self._kv_cache_manager is not None
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._producers.get(req_id)
            if request is not None:
                self._checksums.add_send(
                    RequestAt(request, request.num_computed_tokens + num_tokens),
                    num_tokens,
                    self._kv_cache_manager,
                )
        verdicts, self._loads.verdicts = self._loads.verdicts, {}
        return self._checksums.build_checksum_meta(), verdicts

    @_timed
    def on_request_finished(
        self, request: Request, kv_transfer_params: dict[str, Any] | None
    ) -> None:
        """After the inner connector's ``request_finished*``: the request's
        checksums go into ``kv_transfer_params`` once the step's results are
        in (:meth:`on_step_output`)."""
        self._producers.pop(request.request_id, None)
        self._num_local_tokens.pop(request.request_id, None)
        if self._checksums is not None:
            self._finished.append(_Finished(request, kv_transfer_params))

    @_timed
    def on_step_output(
        self, output: KVConnectorOutput, meta: KVGuardWorkerMetadata | None
    ) -> None:
        """Take the workers' checksums, verify the loads every worker has
        checksummed, and send the checksums of the requests that finished."""
        if self._checksums is None:
            return
        if meta is None and not output.failed_recving:
            # Most steps: nothing checksummed, nothing failed.
            self._flush()
            return
        records: list[KVChecksumRecord] = []
        complete: set[str] = set()
        for report in meta.reports if meta is not None else ():
            if report.record is not None:
                records.append(report.record)
            for req_id in report.finished_loads:
                self._loads.reported[req_id] += 1
                if self._loads.reported[req_id] >= self._num_workers:
                    del self._loads.reported[req_id]
                    complete.add(req_id)
        # vLLM already failed these: nothing to verify, the state is dropped.
        failed_by_inner = set(output.failed_recving or ())
        self._checksums.update_from_output(
            _StepOutput(records, complete | failed_by_inner), failed_by_inner
        )
        failed = self._checksums.take_load_failures()
        if self._checksums.fail_closed:
            # The workers hold these loads until they hear.
            for req_id in complete:
                self._loads.verdicts[req_id] = req_id in failed
        for req_id, message in sorted(failed.items()):
            self._failed_loads[req_id] = message
            logger.error("KVGuard fails the KV load (fail-closed). %s.", message)
        self._flush()

    @_timed
    def flush_finished(self) -> None:
        """Send the checksums of the requests finished since the last call."""
        self._flush()

    def _flush(self) -> None:
        if self._checksums is None or not self._finished:
            return
        finished, self._finished = self._finished, []
        for item in finished:
            self._checksums.request_finished(item.request, item.kv_transfer_params)

    def take_stats(self) -> dict[str, Any] | None:
        """Outcome counts since the last call, or None if none changed."""
        if self._checksums is None:
            return None
        now, before = self._checksums.stats, self._reported
        if (
            (now.verified, now.mismatch, now.sent)
            == (before.verified, before.mismatch, before.sent)
            and now.unverified == before.unverified
            and now.not_sent == before.not_sent
        ):
            # Nothing happened (most steps): the time waits for an outcome.
            return None
        counts = checksum_deltas(now, before)
        counts["failed_loads"] = len(self._failed_loads)
        counts["failed_requests"], self._failed_loads = self._failed_loads, {}
        counts["scheduler_seconds"], self._seconds = self._seconds, 0.0
        self._reported = snapshot(now)
        return counts
