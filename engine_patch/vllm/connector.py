"""``KVGuardConnector``: a vLLM KV connector that wraps the deployment's real
one (NixlConnector by default) and checksums the KV it moves.

Every call goes to the inner connector; KVGuard adds the checksums of
engine_patch around them (:mod:`engine_patch.vllm.scheduler_side` in the
scheduler process, :mod:`engine_patch.vllm.worker_side` in each worker) and
wraps the inner connector's metadata and stats in its own.

It runs in one of two modes, logged at startup:

- same-step verdicts, with KVGuard's scheduler class
  (``--scheduler-cls engine_patch.vllm.scheduler.KVGuardScheduler``, or
  ``KVGuardAsyncScheduler`` with async scheduling): each finished load is
  verified in the ``update_from_output`` that reports it, so no load waits;
- connector-only: a fail-closed load is held back one engine step, until
  the scheduler's verdict reaches the workers in the next step's metadata.

The workers learn the mode from each step's metadata (``hold_loads``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput

from engine_patch.log import get_logger
from engine_patch.vllm._logging import use_vllm_handlers
from engine_patch.vllm.config import (
    KVGuardConfigError,
    KVGuardSettings,
    inner_connector_class,
    inner_vllm_config,
    parse_settings,
    without_hybrid_manager,
)
from engine_patch.vllm.metadata import KVGuardConnectorMetadata, KVGuardWorkerMetadata
from engine_patch.vllm.scheduler_side import KVGuardSchedulerSide
from engine_patch.vllm.stats import KVGuardConnectorStats, KVGuardPromMetrics
from engine_patch.vllm.worker_side import KVGuardWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


logger = get_logger(__name__)

# Set on KVGuard's scheduler classes: they verify loads in the connector's
# stead (engine_patch.vllm.scheduler).
SAME_STEP_VERDICTS_ATTR = "kvguard_same_step_verdicts"


def _same_step_scheduler(vllm_config: VllmConfig) -> bool:
    """Whether the configured scheduler class is one of KVGuard's (it then
    calls :meth:`KVGuardConnector.use_same_step_verdicts` once built)."""
    configured = vllm_config.scheduler_config.scheduler_cls
    if isinstance(configured, str):
        try:
            configured = vllm_config.scheduler_config.get_scheduler_cls()
        except (ImportError, AttributeError, ValueError):
            return False  # vLLM reports it when it builds the scheduler.
    return bool(getattr(configured, SAME_STEP_VERDICTS_ATTR, False))


# Why KVGuard refuses to be one of a MultiConnector's connectors.
INSIDE_MULTI_CONNECTOR = (
    "KVGuardConnector is one of a MultiConnector's connectors: from there it "
    "cannot verify the KV its sibling connectors load, and vLLM's scheduler "
    "finds no KVGuard to verify loads with. Put KVGuard around the "
    'MultiConnector instead: "kv_connector": "KVGuardConnector", '
    '"kv_connector_module_path": "engine_patch.vllm", and '
    '"kv_connector_extra_config": {"inner": {"kv_connector": '
    '"MultiConnector", "kv_connector_extra_config": {"connectors": '
    "[...]}}} (or set kv_checksums.enabled to false)"
)


def _built_by_multi_connector() -> bool:
    """Whether the connector being built is one of a MultiConnector's
    ``connectors``: MultiConnector's ``__init__`` is among its callers
    (vLLM gives a child no other sign of its parent)."""
    parent_init = MultiConnector.__init__.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is parent_init:
            return True
        frame = frame.f_back
    return False


class KVGuardConnector(KVConnectorBase_V1, SupportsHMA):
    """Checksums the KV the inner connector transfers: a producer's prompt
    KV into its ``kv_transfer_params["kv_checksums"]``, a consumer's loads
    verified against them before the request can decode.

    Raises:
        KVGuardConfigError: At startup, if ``kv_connector_extra_config`` is
            invalid, the inner connector cannot be loaded, it lacks the
            hybrid KV cache manager's support for a KV cache that manager
            lays out (``without_hybrid_manager``), or checksums are on and
            KVGuard is built inside a MultiConnector rather than around it.
    """

    # Whether ``fault_injection`` is read (the fault-injection subclass).
    _injects_faults = False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        use_vllm_handlers()
        self._settings = self._parse(vllm_config)
        if self._settings.kv_checksums.enabled and _built_by_multi_connector():
            raise KVGuardConfigError(INSIDE_MULTI_CONNECTOR)
        inner_config = inner_vllm_config(vllm_config, self._settings)
        assert inner_config.kv_transfer_config is not None
        self._inner_ktc = inner_config.kv_transfer_config
        inner_cls = inner_connector_class(self._inner_ktc)
        if not (
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
            or KVConnectorFactory.supports_hma_config(self._inner_ktc)
        ):
            inner_config = without_hybrid_manager(inner_config, kv_cache_config)
        self._inner: KVConnectorBase_V1 = inner_cls(inner_config, role, kv_cache_config)
        self._scheduler: KVGuardSchedulerSide | None = None
        self._worker: KVGuardWorker | None = None
        # The hold_loads the workers were last sent (build_connector_meta).
        self._hold_loads_sent: bool | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KVGuardSchedulerSide(
                vllm_config, kv_cache_config, self._inner, self._settings
            )
            if not _same_step_scheduler(vllm_config):
                self._log_mode()
        else:
            self._worker = self._make_worker(vllm_config, kv_cache_config)

    @classmethod
    def _parse(cls, vllm_config: VllmConfig) -> KVGuardSettings:
        assert vllm_config.kv_transfer_config is not None
        return parse_settings(
            vllm_config.kv_transfer_config, fault_injection=cls._injects_faults
        )

    def _make_worker(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> KVGuardWorker:
        return KVGuardWorker(vllm_config, kv_cache_config, self._settings)

    @property
    def inner(self) -> KVConnectorBase_V1:
        """The wrapped connector."""
        return self._inner

    def _log_mode(self) -> None:
        assert self._scheduler is not None
        if not self._scheduler.enabled:
            logger.info("KVGuard: KV checksums are disabled.")
        elif self._scheduler.same_step:
            logger.info(
                "KVGuard mode: same-step verdicts (the scheduler class verifies "
                "each finished KV load in the step that reports it; no load waits)."
            )
        elif self._scheduler.hold_loads:
            logger.info(
                "KVGuard mode: connector-only (each finished KV load waits one "
                "engine step for its verdict; --scheduler-cls "
                "engine_patch.vllm.scheduler.KVGuardScheduler verifies it in the "
                "same step)."
            )
        else:
            logger.info(
                "KVGuard mode: connector-only, fail-open (loads are verified "
                "after they finish and used whatever the outcome)."
            )

    # ==============================
    # KVGuard's scheduler class
    # ==============================

    def use_same_step_verdicts(self) -> None:
        """Called by KVGuard's scheduler class once, at startup: it verifies
        each step's finished loads (:meth:`verify_finished_loads`), so the
        workers release them at once."""
        assert self._scheduler is not None
        self._scheduler.use_same_step_verdicts()
        self._log_mode()

    def verify_finished_loads(
        self,
        connector_output: KVConnectorOutput,
        scheduler_output: SchedulerOutput | None = None,
    ) -> None:
        """Verify the step's finished loads before vLLM reads its failed ones:
        each load that fails verification (fail-closed) is added to
        ``connector_output.failed_recving``, or, for a load the inner
        connector made in the forward of ``scheduler_output``'s step, its
        blocks to ``invalid_block_ids``. ``update_connector_output``, called
        later with the same output, does not verify them again."""
        assert self._scheduler is not None
        self._scheduler.verify_finished_loads(
            connector_output,
            () if scheduler_output is None else self.sync_loads(scheduler_output),
        )

    @staticmethod
    def sync_loads(scheduler_output: SchedulerOutput) -> Sequence[str]:
        """The loads the inner connector makes in the forward of
        ``scheduler_output``'s step (``load_kv_async=False``)."""
        meta = scheduler_output.kv_connector_metadata
        return meta.sync_loads if isinstance(meta, KVGuardConnectorMetadata) else ()

    # ==============================
    # Class methods: the inner connector's, from the config.
    # ==============================

    @classmethod
    def _inner_class_and_config(
        cls, vllm_config: VllmConfig
    ) -> tuple[type[KVConnectorBase_V1], VllmConfig]:
        settings = cls._parse(vllm_config)
        inner_config = inner_vllm_config(vllm_config, settings)
        assert inner_config.kv_transfer_config is not None
        inner_cls = inner_connector_class(inner_config.kv_transfer_config)
        return inner_cls, inner_config

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        inner_cls, inner_config = cls._inner_class_and_config(vllm_config)
        return inner_cls.get_required_kvcache_layout(inner_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        inner = extra_config.get("inner") or {}
        from vllm.config import KVTransferConfig

        try:
            inner_cls = inner_connector_class(
                KVTransferConfig(**{"kv_role": "kv_both", **inner})
            )
        except (TypeError, ValueError):
            return False  # Reported with context when the connector is built.
        return inner_cls.requires_piecewise_for_cudagraph(
            inner.get("kv_connector_extra_config", {})
        )

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVGuardConnectorStats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        inner_cls, inner_config = cls._inner_class_and_config(vllm_config)
        inner = inner_cls.build_prom_metrics(
            inner_config, metric_types, labelnames, per_engine_labelvalues
        )
        return KVGuardPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, inner
        )

    # ==============================
    # Both roles
    # ==============================

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    def shutdown(self) -> None:
        self._inner.shutdown()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner = self._inner.get_kv_connector_stats()
        if self._scheduler is not None:
            # Called at the end of every update_from_output: the last point
            # at which a finished request's params can still be filled.
            self._scheduler.flush_finished()
            # Every count, never all zero; None if no outcome changed.
            counts = self._scheduler.take_stats()
            if counts is None and inner is None:
                return None
            stats = KVGuardConnectorStats(
                None if counts is None else {"kv_checksums": counts}
            )
            may_be_empty = counts is None
        else:
            assert self._worker is not None
            taken = self._worker.take_stats()
            if taken is None and inner is None:
                return None
            stats = KVGuardConnectorStats()
            stats.counts.update(taken or {})
            may_be_empty = True
        stats.set_inner(
            self._inner_ktc.kv_connector or "",
            self._inner_ktc.kv_connector_module_path,
            inner,
        )
        return None if may_be_empty and stats.is_empty() else stats

    def reset_cache(self) -> bool | None:
        return self._inner.reset_cache()

    # ==============================
    # Worker side
    # ==============================

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        return self._inner.get_mem_pool_context()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None
        if isinstance(connector_metadata, KVGuardConnectorMetadata):
            self._inner.bind_connector_metadata(connector_metadata.inner)
            self._worker.begin_step(
                connector_metadata.checksums,
                connector_metadata.verdicts,
                hold_loads=connector_metadata.hold_loads,
                sync_loads=connector_metadata.sync_loads,
            )
        else:
            # The inner connector's alone: nothing of KVGuard's this step.
            self._inner.bind_connector_metadata(connector_metadata)
            self._worker.begin_step(None, {})

    def clear_connector_metadata(self) -> None:
        self._inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._inner.register_kv_caches(kv_caches)
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        self._inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        self._inner.finish_forward()

    def reset_capture_state(self) -> None:
        self._inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVGuardConnectorMetadata):
            kv_connector_metadata = kv_connector_metadata.inner
        self._inner.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._inner.wait_for_save()
        assert self._worker is not None
        self._worker.after_forward()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        results = self._inner.get_transfer_results(finished_req_ids)
        assert self._worker is not None
        self._worker.on_transfer_results(results, finished_req_ids)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._inner.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self._inner.get_kv_connector_kv_cache_events()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._inner.get_handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self._inner.build_connector_worker_meta()
        assert self._worker is not None
        report = self._worker.take_report()
        if inner is None and report is None:
            return None
        return KVGuardWorkerMetadata(inner, [report] if report is not None else [])

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    # ==============================
    # Scheduler side
    # ==============================

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        # Not the base class's: it would bind the block pool to the inner
        # connector a second time.
        self._kv_cache_manager = kv_cache_manager
        self._inner.bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        self._scheduler.on_matched_tokens(request, num_computed_tokens)
        num_external, load_async = self._inner.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if (
            num_external
            and not load_async
            and self._scheduler.refuses_sync_load(request)
        ):
            # vLLM computes the prompt; the inner connector hears of no load
            # in update_state_after_alloc (0 tokens).
            return 0, False
        return num_external, load_async

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        assert self._scheduler is not None
        self._scheduler.on_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        """The inner connector's metadata, wrapped with KVGuard's only in
        steps that have some for the workers: vLLM pickles the metadata to
        its workers every step, and most steps have nothing of KVGuard's."""
        assert self._scheduler is not None
        checksums, verdicts, sync_loads = self._scheduler.build_meta(scheduler_output)
        inner = self._inner.build_connector_meta(scheduler_output)
        hold_loads = self._scheduler.hold_loads
        if checksums is None and not verdicts and hold_loads == self._hold_loads_sent:
            return inner
        self._hold_loads_sent = hold_loads
        return KVGuardConnectorMetadata(
            inner, hold_loads, checksums, verdicts, sync_loads
        )

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)
        self._inner.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        assert meta is None or isinstance(meta, KVGuardWorkerMetadata)
        # The inner connector sees its own workers' metadata, as in
        # MultiConnector.
        connector_output.kv_connector_worker_meta = None if meta is None else meta.inner
        try:
            self._inner.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = meta
        assert self._scheduler is not None
        self._scheduler.on_step_output(connector_output, meta)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = self._inner.request_finished(request, block_ids)
        assert self._scheduler is not None
        self._scheduler.on_request_finished(request, params)
        return delay_free, params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        inner = self._inner
        if isinstance(inner, SupportsHMA):
            delay_free, params = inner.request_finished_all_groups(request, block_ids)
        else:
            (group_block_ids,) = block_ids
            delay_free, params = self._inner.request_finished(request, group_block_ids)
        assert self._scheduler is not None
        self._scheduler.on_request_finished(request, params)
        return delay_free, params

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self._inner.register_finished_partial_tail(
            request, block_ids, partial_tail_offloads
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._inner.has_pending_push_work()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self._inner.set_xfer_handshake_metadata_pp_aware(metadata)
