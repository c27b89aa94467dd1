"""What the workers report, and when, through vLLM's own code: every
finished load gets a verdict whatever one rank saw, and a producer's send
checksums are in the step that finishes its prompt, speculative decoding
or not. In process: only the inner connector and the checksum kernel are
stubs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import vllm.v1.worker.kv_connector_model_runner_mixin as mixin
from engine_steps import block_checksums, consumer_params, request
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.v1.request import RequestStatus
from worker_steps import (
    RECORD,
    N,
    StubKernel,
    consumer,
    held,
    run_step,
    stub_worker,
)

from engine_patch.types import KVChecksumBlocks, KVChecksumScheduled
from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.metadata import KVGuardConnectorMetadata, KVGuardWorkerMetadata

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("fail_closed", [True, False])
def test_a_load_one_rank_failed_still_gets_a_verdict(fail_closed: bool) -> None:
    sched = consumer(tp=2, fail_closed=fail_closed)
    workers = [stub_worker(), stub_worker()]
    aggregator = KVOutputAggregator(2)
    sched.add_request(
        request("r1", N, consumer_params(N, block_checksums(N)), max_tokens=1)
    )
    run_step(sched, workers, aggregator, {})  # the load starts
    # The transfer fails on rank 0; rank 1 loads its shard.
    failed = KVConnectorTransferResults(finished_recving={"r1"}, failed_recving={"r1"})
    loaded = KVConnectorTransferResults(finished_recving={"r1"})
    run_step(sched, workers, aggregator, {0: failed, 1: loaded})
    for _ in range(4):
        run_step(sched, workers, aggregator, {})
    # Failed (kv_load_failure_policy "fail"), not waiting for ever; nothing
    # of it left behind on either side.
    assert "r1" not in sched.requests
    assert held(sched, workers) == [set(), set(), set()]
    # A failed transfer, as vLLM says: not a load KVGuard found unverified.
    connector = sched.connector
    assert isinstance(connector, KVGuardConnector) and connector._scheduler
    stats = connector._scheduler.stats
    assert (stats.verified, stats.mismatch, dict(stats.unverified)) == (0, 0, {})


def test_a_finished_load_a_worker_was_not_told_of_waits_for_its_verdict() -> None:
    # The step's checksum metadata did not reach the workers (it would not
    # decode): they never heard of the load's blocks when it finishes.
    sched = consumer(tp=1)
    workers = [stub_worker()]
    aggregator = KVOutputAggregator(1)
    sched.add_request(request("r1", N, consumer_params(N, block_checksums(N))))
    run_step(sched, workers, aggregator, {}, scheduled=False)
    done = KVConnectorTransferResults(finished_recving={"r1"})
    run_step(sched, workers, aggregator, {0: done})
    ran: set[str] = set()
    for _ in range(4):
        ran |= run_step(sched, workers, aggregator, {})
    # Unverified, so failed (fail-closed): never decoded from unchecked KV.
    assert "r1" not in ran
    assert "r1" not in sched.requests or (
        sched.requests["r1"].status != RequestStatus.WAITING_FOR_REMOTE_KVS
    )
    assert not workers[0]._held


def test_a_load_made_in_the_steps_forward_is_checksummed_after_it() -> None:
    worker = stub_worker()
    blocks = KVChecksumBlocks(96, {0: (0, [1, 2, 3])})
    worker.begin_step(
        KVChecksumScheduled(reqs_to_recv={"r1": blocks}),
        {},
        hold_loads=False,
        sync_loads=["r1"],
    )
    # The inner connector never reports a synchronous load as finished.
    results = KVConnectorTransferResults()
    worker.on_transfer_results(results, set())
    kernel = worker._checksums
    assert isinstance(kernel, StubKernel)
    assert kernel.loads_checksummed == ["r1"]
    assert not results.finished_recving and not results.failed_recving
    report = worker.take_report()
    assert report is not None and report.finished_loads == ["r1"]
    # Once: the next step has it no more.
    worker.begin_step(None, {})
    worker.on_transfer_results(KVConnectorTransferResults(), set())
    assert kernel.loads_checksummed == ["r1"]


def _connector() -> KVGuardConnector:
    """A worker-side KVGuardConnector over a stub inner connector."""
    inner = SimpleNamespace(
        bind_connector_metadata=lambda metadata: None,
        clear_connector_metadata=lambda: None,
        start_load_kv=lambda forward_context, **kwargs: None,
        wait_for_save=lambda: None,
        get_transfer_results=lambda ids: KVConnectorTransferResults(),
        get_block_ids_with_load_errors=lambda: set(),
        get_kv_connector_stats=lambda: None,
        get_kv_connector_kv_cache_events=lambda: None,
        build_connector_worker_meta=lambda: None,
    )
    connector = object.__new__(KVGuardConnector)
    connector._inner = inner  # type: ignore[assignment]
    connector._worker = stub_worker()
    connector._scheduler = None
    connector._inner_ktc = SimpleNamespace(  # type: ignore[assignment]
        kv_connector="NixlConnector", kv_connector_module_path=None
    )
    connector._connector_metadata = None
    return connector


@pytest.mark.parametrize(
    "defer_finalize", [False, True], ids=["no-spec", "speculative-decoding"]
)
def test_a_prefill_steps_report_carries_its_send_checksums(
    monkeypatch: pytest.MonkeyPatch, defer_finalize: bool
) -> None:
    # With a speculative config vLLM builds the step's worker report before
    # wait_for_save (finalize_kv_connector runs after the drafter).
    connector = _connector()
    monkeypatch.setattr(mixin, "get_kv_transfer_group", lambda: connector)
    monkeypatch.setattr(mixin, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    sends = {"p1": KVChecksumBlocks(N, {0: (0, [1, 2, 3, 4])})}
    metadata = KVGuardConnectorMetadata(
        KVConnectorMetadata(),
        hold_loads=False,
        checksums=KVChecksumScheduled(reqs_to_send=sends),
    )
    scheduler_output = SimpleNamespace(
        kv_connector_metadata=metadata, has_sync_kv_loads=False, finished_req_ids=set()
    )
    with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(
        scheduler_output,  # type: ignore[arg-type]
        defer_finalize=defer_finalize,
    ) as output:
        pass  # the target model's forward
    if defer_finalize:
        mixin.KVConnectorModelRunnerMixin.finalize_kv_connector()
    meta = output.kv_connector_worker_meta
    assert isinstance(meta, KVGuardWorkerMetadata)
    assert [report.record for report in meta.reports] == [RECORD]
