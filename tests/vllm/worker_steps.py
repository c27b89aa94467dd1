"""vLLM 0.32's real scheduler and output aggregator over KVGuard's real
worker logic, one per TP rank, in process: only the inner connector (its
transfer results are given per step) and the checksum kernel are stubs."""

from __future__ import annotations

from typing import Any

import numpy as np
from engine_steps import (
    make_scheduler,
    runner_output,
    shipped,
    vllm_config,
    worker_record,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from engine_patch.types import KVChecksumScheduled
from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.metadata import KVGuardConnectorMetadata, KVGuardWorkerMetadata
from engine_patch.vllm.worker_side import KVGuardWorker

N = 100
RECORD = object()  # stands for a step's KVChecksumRecord


class StubKernel:
    """KVChecksumWorker's contract, without KV: sends begun in ``begin_step``
    are checksummed by ``after_forward`` and reported by the next
    ``take_record``. Loads give no record (so they are unverified), unless
    ``load_sums`` is set: then rank 0 reports them as each load's checksums
    (flipped for loads in ``corrupted``) and other ranks zeros, so that the
    ranks' sums add up to them."""

    def __init__(self, rank: int = 0, load_sums: np.ndarray | None = None) -> None:
        self.rank = rank
        self.load_sums = load_sums
        self.corrupted: set[str] = set()
        self.sends: dict[str, Any] = {}
        self.ready: object | None = None
        self.loaded: dict[str, np.ndarray] = {}
        self.loads_checksummed: list[str] = []

    def begin_step(self, scheduled: KVChecksumScheduled | None) -> None:
        self.sends = dict(scheduled.reqs_to_send) if scheduled else {}

    def after_forward(self) -> None:
        if self.sends:
            self.ready, self.sends = RECORD, {}

    def on_loads_finished(self, done: list[str]) -> None:
        self.loads_checksummed += done
        if self.load_sums is None:
            return
        for req_id in done:
            sums = self.load_sums if self.rank == 0 else 0 * self.load_sums
            if req_id in self.corrupted and self.rank == 0:
                sums = sums ^ np.uint64(1)
            self.loaded[req_id] = sums

    def request_finished(self, req_ids: set[str]) -> None:
        pass

    def held_request_ids(self) -> set[str]:
        return {*self.sends, *self.loaded}

    def take_record(self) -> object | None:
        if self.loaded:
            loaded, self.loaded = self.loaded, {}
            return worker_record(loaded, tp_rank=self.rank)
        record, self.ready = self.ready, None
        return record


def held(sched: Scheduler, workers: list[KVGuardWorker]) -> list[set[str]]:
    """What KVGuard's scheduler side, then each worker, holds state of."""
    connector = sched.connector
    assert isinstance(connector, KVGuardConnector) and connector._scheduler
    return [
        connector._scheduler.held_request_ids(),
        *(worker.held_request_ids() for worker in workers),
    ]


def stub_worker(rank: int = 0, load_sums: np.ndarray | None = None) -> KVGuardWorker:
    """KVGuard's real worker logic over the stub kernel (no KV tensors)."""
    worker = object.__new__(KVGuardWorker)
    worker._hold = None
    worker._checksums = StubKernel(rank, load_sums)  # type: ignore[assignment]
    worker._layers, worker._block_bytes = [], {}
    worker._loads, worker._held, worker._verdicts = {}, {}, {}
    worker._finished_loads, worker._failed_loads = [], []
    worker._sync_loads = []
    worker._busy, worker._bytes, worker._seconds = False, 0, 0.0
    worker._hold_seconds, worker._num_held = 0.0, 0
    return worker


def run_step(
    sched: Scheduler,
    workers: list[KVGuardWorker],
    aggregator: KVOutputAggregator,
    results: dict[int, KVConnectorTransferResults],
    *,
    scheduled: bool = True,
) -> set[str]:
    """One engine step over ``workers`` (one per TP rank), each given its
    inner connector's ``results``; ``scheduled=False`` loses the step's
    checksum metadata on the workers. The requests the step scheduled."""
    out = sched.schedule()
    sched.update_from_output(
        out, execute(sched, out, workers, aggregator, results, scheduled=scheduled)
    )
    return set(out.num_scheduled_tokens)


def execute(
    sched: Scheduler,
    out: SchedulerOutput,
    workers: list[KVGuardWorker],
    aggregator: KVOutputAggregator,
    results: dict[int, KVConnectorTransferResults],
    *,
    scheduled: bool = True,
) -> ModelRunnerOutput:
    """The workers run the step ``out``; their output, merged as vLLM's
    executor merges the ranks'."""
    # Scheduled a chunk of their prompt that is not its last: no token.
    prefilling = {
        r
        for r in out.num_scheduled_tokens
        if sched.requests[r].num_computed_tokens < sched.requests[r].num_prompt_tokens
    }
    meta = shipped(out.kv_connector_metadata)
    per_rank = []
    for rank, worker in enumerate(workers):
        if isinstance(meta, KVGuardConnectorMetadata):
            worker.begin_step(
                meta.checksums if scheduled else None,
                meta.verdicts,
                hold_loads=meta.hold_loads,
                sync_loads=meta.sync_loads,
            )
        else:  # nothing of KVGuard's this step
            worker.begin_step(None, {})
        got = results.get(rank, KVConnectorTransferResults())
        worker.on_transfer_results(got, set(out.finished_req_ids))
        report = worker.take_report()
        output = KVConnectorOutput(
            finished_recving=got.finished_recving,
            failed_recving=got.failed_recving,
            finished_sending=got.finished_sending,
            kv_connector_worker_meta=None
            if report is None
            else KVGuardWorkerMetadata(None, [report]),
        )
        per_rank.append(shipped(runner_output(out, output, prefilling)))
    merged = aggregator.aggregate(per_rank)
    assert merged is not None
    return merged


class Steps:
    """Engine steps over ``workers``, as vLLM's engine core runs them:
    one at a time, or ``pipelined`` as under async scheduling (a batch
    queue of two), where step N+1 is scheduled and its workers run before
    step N's output reaches ``update_from_output``."""

    def __init__(
        self,
        sched: Scheduler,
        workers: list[KVGuardWorker],
        aggregator: KVOutputAggregator,
        pipelined: bool,
    ) -> None:
        self.sched = sched
        self.workers = workers
        self.aggregator = aggregator
        self.pipelined = pipelined
        self._pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def step(self, results: dict[int, KVConnectorTransferResults]) -> set[str]:
        """One step, each rank given its inner connector's ``results``; the
        requests it scheduled."""
        if not self.pipelined:
            return run_step(self.sched, self.workers, self.aggregator, results)
        out = self.sched.schedule()
        merged = execute(self.sched, out, self.workers, self.aggregator, results)
        self.drain()
        self._pending = (out, merged)
        return set(out.num_scheduled_tokens)

    def drain(self) -> None:
        """The step in flight, if any, reaches ``update_from_output``."""
        if self._pending is not None:
            self.sched.update_from_output(*self._pending)
            self._pending = None


def engine(
    role: str,
    tp: int,
    fail_closed: bool = True,
    cls: type[Scheduler] = Scheduler,
    step_tokens: int | None = None,
) -> Scheduler:
    """vLLM's scheduler of class ``cls`` for an engine of ``tp`` ranks, each
    step scheduling up to ``step_tokens`` tokens (chunked prefill) if set."""
    config = vllm_config(role, fail_closed=fail_closed)
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.world_size = tp
    if step_tokens is not None:
        config.scheduler_config.max_num_batched_tokens = step_tokens
    return make_scheduler(cls, config)


def consumer(tp: int, fail_closed: bool = True) -> Scheduler:
    return engine("kv_consumer", tp, fail_closed)
