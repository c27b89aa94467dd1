"""KVGuard in a vLLM worker: checksums the KV tensors vLLM registers with
engine_patch's :class:`~engine_patch.worker.KVChecksumWorker` and, when the
scheduler says so (fail-closed without KVGuard's scheduler class), holds
each finished load back from vLLM until the scheduler's verdict on it.

Per step vLLM calls, in order: ``bind_connector_metadata`` (the scheduler's
checksums, verdicts and whether to hold loads), the forward,
``start_load_kv``, ``wait_for_save`` (a producer's prompt KV is final:
checksummed), ``get_transfer_results`` (finished loads are checksummed
before any later step can write their blocks, and go to vLLM at once or are
held; held loads with a verdict are released, failed ones as failed loads),
``build_connector_worker_meta`` (the step's checksums).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

import torch

from engine_patch import checksum_kernel
from engine_patch.log import get_logger
from engine_patch.types import KVChecksumBlocks, KVChecksumScheduled
from engine_patch.vllm.host import convert_kv_cache_config, kv_layers
from engine_patch.vllm.metadata import WorkerReport
from engine_patch.worker import AnyLayer, KVChecksumWorker, KVLayer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from engine_patch.vllm.config import KVGuardSettings

logger = get_logger(__name__)

_T = TypeVar("_T")


def _enable_amx() -> None:
    """Ask Linux for AMX tile state on CPUs that have it.

    vLLM 0.32's CPU attention runs AMX kernels without asking, which raises
    SIGILL in a process whose first forward is a decode of loaded KV (a P/D
    consumer): nothing had asked yet (oneDNN does, for prefill matmuls).
    """
    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()


def _block_bytes(layers: Iterable[AnyLayer]) -> dict[int, int]:
    """Per group, the bytes of one block over its distinct KV (or state)
    tensors."""
    seen: set[tuple[int, int]] = set()
    sizes: dict[int, int] = {}
    for layer in layers:
        tensors = (
            [layer.kv]
            if isinstance(layer, KVLayer)
            else [state.state for state in layer.states]
        )
        for tensor in tensors:
            key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
            if key in seen:
                continue
            seen.add(key)
            sizes[layer.group_id] = (
                sizes.get(layer.group_id, 0) + tensor[0].numel() * tensor.element_size()
            )
    return sizes


class KVGuardWorker:
    """The worker-side checksum logic of one worker."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        settings: KVGuardSettings,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._settings = settings
        config = settings.checksum_config(vllm_config)
        self._enabled = config.enabled
        # Whether finished loads wait for verdicts: the scheduler's choice,
        # in each step's metadata (None before the first).
        self._hold: bool | None = None
        self._covered = convert_kv_cache_config(
            kv_cache_config, fail_closed=config.fail_closed, vllm_config=vllm_config
        ).transfer_group_ids
        self._checksums: KVChecksumWorker | None = None
        self._layers: list[AnyLayer] = []
        self._block_bytes: dict[int, int] = {}
        # Loads the scheduler asked to checksum, by request id: their blocks.
        self._loads: dict[str, KVChecksumBlocks] = {}
        # Checksummed loads held back from vLLM until their verdicts: when.
        self._held: dict[str, float] = {}
        self._verdicts: dict[str, bool] = {}
        self._finished_loads: list[str] = []
        self._failed_loads: list[str] = []
        # Loads the inner connector makes in this step's forward: checksummed
        # after it, with the step's finished loads.
        self._sync_loads: list[str] = []
        # Whether this step checksums anything (sends or loads).
        self._busy = False
        self._bytes = 0
        self._seconds = 0.0
        self._hold_seconds = 0.0
        self._num_held = 0
        if vllm_config.device_config.device_type == "cpu":
            _enable_amx()

    @property
    def layers(self) -> list[AnyLayer]:
        """The KV and state layers checksummed (empty before registration)."""
        return self._layers

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Plan the checksums of the KV tensors vLLM allocated.

        Raises:
            UnsupportedKVCacheError: If a covered layer's tensor is not in the
                layout vLLM 0.32 documents.
        """
        if not self._enabled:
            return
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank = get_tp_group().rank_in_group
        self._layers = kv_layers(
            self._vllm_config,
            self._kv_cache_config,
            kv_caches,
            covered_groups=set(self._covered),
            tp_rank=tp_rank,
        )
        self._block_bytes = _block_bytes(self._layers)
        self._checksums = KVChecksumWorker(
            self._layers,
            tp_rank=tp_rank,
            pp_rank=get_pp_group().rank_in_group,
            compile=self._settings.kv_checksums.compile,
        )
        kinds: dict[int, str] = {
            layer.group_id: layer.spec_type for layer in self._layers
        }
        logger.info(
            "KVGuard checksums %d KV layers (groups %s; skipped %s).",
            len(self._layers),
            ", ".join(f"{g}: {kind}" for g, kind in sorted(kinds.items())),
            sorted(self._checksums.skipped_groups),
        )
        if self._checksums.compiled:
            self._warm_up(self._checksums)

    @staticmethod
    def _warm_up(checksums: KVChecksumWorker) -> None:
        """Build or load the fused kernel now, while vLLM starts, rather than
        in the first step that checksums (about 10 s per row shape to build on
        an idle CPU, minutes on a loaded one; under a second to load one built
        before): into
        ``$VLLM_CACHE_ROOT/kvguard`` unless ``KVGUARD_CHECKSUM_CACHE_DIR``
        names another folder."""
        import vllm.envs

        if checksum_kernel.cache_dir() is None:
            checksum_kernel.set_cache_dir(
                os.path.join(vllm.envs.VLLM_CACHE_ROOT, "kvguard")
            )
        start = time.perf_counter()
        # vLLM runs its steps, and so the passes, in inference mode; dynamo
        # (a device's kernel) guards on it, so a kernel warmed up outside it
        # would compile again in a step.
        with torch.inference_mode():
            checksums.warm_up()
        if checksums.compiled:
            logger.info(
                "KVGuard prepared its KV checksum kernel in %.1f s (code in %s).",
                time.perf_counter() - start,
                checksum_kernel.cache_dir(),
            )

    def begin_step(
        self,
        scheduled: KVChecksumScheduled | None,
        verdicts: Mapping[str, bool],
        *,
        hold_loads: bool | None = None,
        sync_loads: Iterable[str] = (),
    ) -> None:
        """Take the scheduler's checksums and verdicts for this step, whether
        finished loads wait for their verdicts (None: as before), and the
        loads the inner connector makes in this step's forward."""
        if hold_loads is not None and hold_loads != self._hold:
            self._hold = hold_loads
            logger.info(
                "KVGuard worker: finished KV loads %s.",
                "wait for the scheduler's verdict (one engine step)"
                if hold_loads
                else "go to vLLM in the step they finish",
            )
        if verdicts:
            # Every rank hears every verdict; one that holds no such load
            # (the inner connector failed it here) drops it.
            self._verdicts.update(
                (req_id, failed)
                for req_id, failed in verdicts.items()
                if req_id in self._held
            )
        if self._checksums is None:
            return
        self._busy = False
        self._sync_loads = list(sync_loads)
        if scheduled is not None:
            self._loads.update(scheduled.reqs_to_recv)
            self._loads.update(scheduled.reqs_to_load)
            if scheduled.reqs_to_send:
                self._busy = True
                self._count_bytes(scheduled.reqs_to_send.values())
        self._checksums.begin_step(scheduled)

    def after_forward(self) -> None:
        """The step's prompts are final: checksum the sends."""
        if self._checksums is None:
            return
        if self._busy:
            self._timed(self._checksums.after_forward)
        else:
            self._checksums.after_forward()

    def on_transfer_results(
        self, results: KVConnectorTransferResults, finished_req_ids: set[str]
    ) -> None:
        """Checksum the loads the inner connector finished and, fail-closed,
        hold them; release those with verdicts (a failed verdict as a failed
        load). Edits ``results`` in place."""
        if self._checksums is not None and (self._loads or self._hold):
            finished = results.finished_recving - results.failed_recving
            done = [req_id for req_id in finished if req_id in self._loads]
            # Made in this step's forward, now over: never in finished_recving.
            done += [r for r in self._sync_loads if r in self._loads]
            self._sync_loads = []
            for req_id in results.failed_recving:
                # The inner connector failed it here: vLLM handles it,
                # unchecked. Still reported, so that the scheduler's count of
                # reports completes (its verdict: failed, not compared) and
                # another rank that loaded it and holds it lets it go.
                if self._loads.pop(req_id, None) is not None:
                    self._failed_loads.append(req_id)
            if done:
                loads = {req_id: self._loads.pop(req_id) for req_id in done}
                self.before_checksum(loads)
                self._count_bytes(loads.values())
                checksums = self._checksums
                self._busy = True
                self._timed(lambda: checksums.on_loads_finished(done))
                self._finished_loads.extend(done)
            if self._hold and finished:
                # Every finished load waits for its verdict, checksummed or
                # not (one whose blocks this worker never heard of is
                # unverified, or not KVGuard's: the scheduler knows which).
                # Without a hold a load was checksummed before any later
                # step can write its blocks, and the scheduler verifies it
                # in the step that reports it (or, fail-open, it goes on
                # whatever the comparison finds).
                unknown = finished.difference(done, self._held)
                self._finished_loads.extend(unknown)
                results.finished_recving.difference_update(finished)
                now = time.perf_counter()
                self._held.update(dict.fromkeys(finished, now))
        if self._checksums is not None and finished_req_ids:
            self._checksums.request_finished(finished_req_ids)
        if not self._held:
            return
        for req_id in [r for r in self._held if r in self._verdicts]:
            self._hold_seconds += time.perf_counter() - self._held.pop(req_id)
            self._num_held += 1
            results.finished_recving.add(req_id)
            if self._verdicts.pop(req_id):
                results.failed_recving.add(req_id)

    def held_request_ids(self) -> set[str]:
        """The requests the worker holds anything of: loads not finished
        yet, loads held for their verdicts, reports not taken yet, and its
        checksum worker's state (until vLLM's ``finished_req_ids``)."""
        held = {
            *self._loads,
            *self._held,
            *self._verdicts,
            *self._finished_loads,
            *self._failed_loads,
            *self._sync_loads,
        }
        if self._checksums is not None:
            held |= self._checksums.held_request_ids()
        return held

    def before_checksum(self, loads: Mapping[str, KVChecksumBlocks]) -> None:
        """Hook for fault injection: the loads about to be checksummed."""

    def take_report(self) -> WorkerReport | None:
        """The step's checksums and finished loads, if any.

        The step's sends are checksummed first if ``wait_for_save`` has not
        run yet: with speculative decoding vLLM builds the report before it
        (after the target model's forward, which made the prompt's KV final).
        """
        if self._checksums is None:
            return None
        self.after_forward()
        if self._busy:
            record = self._timed(self._checksums.take_record)
        else:
            record = self._checksums.take_record()
        finished, self._finished_loads = self._finished_loads, []
        failed, self._failed_loads = self._failed_loads, []
        if record is None and not finished and not failed:
            return None
        return WorkerReport(record, finished, failed)

    def take_stats(self) -> dict[str, int | float] | None:
        """Since the last call: bytes checksummed and the seconds it took, and
        loads released with their verdicts and the seconds they were held;
        None if nothing was."""
        if not (self._bytes or self._seconds or self._num_held):
            return None
        taken = {
            "checksum_bytes": self._bytes,
            "checksum_seconds": self._seconds,
            "held_loads": self._num_held,
            "hold_seconds": self._hold_seconds,
        }
        self._bytes, self._seconds = 0, 0.0
        self._num_held, self._hold_seconds = 0, 0.0
        return taken

    def _count_bytes(self, requests: Iterable[KVChecksumBlocks]) -> None:
        for blocks in requests:
            for group_id, (_, block_ids) in blocks.groups.items():
                self._bytes += len(block_ids) * self._block_bytes.get(group_id, 0)

    def _timed(self, fn: Callable[[], _T]) -> _T:
        """``fn()``, its time added to the checksum time."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self._seconds += time.perf_counter() - start
