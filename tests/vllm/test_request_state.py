"""A long-running vLLM engine keeps nothing of KVGuard's for its past
requests: once they have ended, however, neither the scheduler side nor any
rank's worker holds state of them. Through vLLM's real scheduler (both of
KVGuard's modes) and output aggregator over KVGuard's worker logic."""

from __future__ import annotations

import pytest
from engine_steps import block_checksums, consumer_params, request
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus
from worker_steps import N, Steps, engine, held, run_step, stub_worker

from engine_patch.vllm.scheduler import KVGuardAsyncScheduler, KVGuardScheduler

pytestmark = pytest.mark.vllm

MODES = {"same-step": KVGuardScheduler, "connector-only": Scheduler}
# Under async scheduling (pipelined steps), each mode's scheduler class.
ASYNC_MODES = {"same-step": KVGuardAsyncScheduler, "connector-only": AsyncScheduler}


@pytest.mark.parametrize("fail_closed", [True, False], ids=["closed", "open"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_consumer_holds_nothing_of_loads_that_ended_in_any_way(
    mode: str, fail_closed: bool
) -> None:
    sched = engine("kv_consumer", 2, fail_closed, MODES[mode])
    workers = [stub_worker(), stub_worker()]
    aggregator = KVOutputAggregator(2)
    params = consumer_params(N, block_checksums(N))
    loads = ["loaded", "failed on one rank", "failed on both", "aborted mid-load"]
    for req_id in [*loads, "aborted before its load"]:
        sched.add_request(request(req_id, N, dict(params), max_tokens=1))
    sched.finish_requests("aborted before its load", RequestStatus.FINISHED_ABORTED)
    run_step(sched, workers, aggregator, {})  # the loads start
    assert held(sched, workers)[0] >= set(loads), "the loads' state not held"
    sched.finish_requests("aborted mid-load", RequestStatus.FINISHED_ABORTED)
    run_step(
        sched,
        workers,
        aggregator,
        {
            0: KVConnectorTransferResults(
                finished_recving=set(loads),
                failed_recving={"failed on one rank", "failed on both"},
            ),
            1: KVConnectorTransferResults(
                finished_recving=set(loads), failed_recving={"failed on both"}
            ),
        },
    )
    for _ in range(4):
        run_step(sched, workers, aggregator, {})

    assert not sched.requests
    assert held(sched, workers) == [set(), set(), set()]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_producer_holds_nothing_of_prefills_that_ended_in_any_way(
    mode: str,
) -> None:
    sched = engine("kv_producer", 1, cls=MODES[mode])
    workers = [stub_worker()]
    aggregator = KVOutputAggregator(1)
    for req_id in ("sent", "aborted before its prefill"):
        sched.add_request(request(req_id, N, {"do_remote_decode": True}, max_tokens=1))
    sched.finish_requests("aborted before its prefill", RequestStatus.FINISHED_ABORTED)
    run_step(sched, workers, aggregator, {})  # the prefill
    run_step(
        sched,
        workers,
        aggregator,
        {0: KVConnectorTransferResults(finished_sending={"sent"})},
    )
    for _ in range(2):
        run_step(sched, workers, aggregator, {})

    assert not sched.requests
    assert held(sched, workers) == [set(), set()]


def _maybe_abort_one(sched: Scheduler, data: st.DataObject) -> None:
    """Abort one unfinished request, or none, as ``data`` draws."""
    live = sorted(r for r, q in sched.requests.items() if not q.is_finished())
    if live and data.draw(st.booleans(), label="abort one"):
        victim = data.draw(st.sampled_from(live), label="aborted")
        sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(list(MODES)),
    pipelined=st.booleans(),
    fail_closed=st.booleans(),
    tp=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_a_consumer_holds_nothing_after_any_interleaving_of_loads_and_aborts(
    mode: str, pipelined: bool, fail_closed: bool, tp: int, data: st.DataObject
) -> None:
    # Each step: requests arrive, some to load corrupted KV, one may be
    # aborted, and each rank's inner connector finishes, fails or keeps each
    # load it has in flight. Then every load left finishes, and the engine
    # runs until it is idle. Fail-closed, no corrupted load is ever decoded.
    # Pipelined: async scheduling, each step's output a step late.
    cls = (ASYNC_MODES if pipelined else MODES)[mode]
    sched = engine("kv_consumer", tp, fail_closed, cls)
    checksums = block_checksums(N)
    workers = [stub_worker(rank, checksums) for rank in range(tp)]
    steps = Steps(sched, workers, KVOutputAggregator(tp), pipelined)
    params = consumer_params(N, checksums)
    added = 0
    corrupted: set[str] = set()
    decoded: set[str] = set()
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            req_id = f"r{added}"
            sched.add_request(request(req_id, N, dict(params), max_tokens=1))
            added += 1
            if data.draw(st.booleans(), label=f"{req_id} corrupted"):
                corrupted.add(req_id)
                for worker in workers:
                    worker._checksums.corrupted.add(req_id)  # type: ignore[union-attr]
        _maybe_abort_one(sched, data)
        results = {}
        for rank, worker in enumerate(workers):
            in_flight = sorted(worker._loads)
            outcome = st.sampled_from(["wait", "finish", "fail"])
            ends = {r: data.draw(outcome, label=f"rank {rank} {r}") for r in in_flight}
            results[rank] = KVConnectorTransferResults(
                finished_recving={r for r, end in ends.items() if end != "wait"},
                failed_recving={r for r, end in ends.items() if end == "fail"},
            )
        decoded |= steps.step(results)
    for _ in range(8):
        decoded |= steps.step(
            {
                rank: KVConnectorTransferResults(finished_recving=set(worker._loads))
                for rank, worker in enumerate(workers)
            }
        )
    steps.drain()

    assert not sched.requests
    assert held(sched, workers) == [set()] * (1 + tp)
    if fail_closed:
        assert not decoded & corrupted


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from(list(MODES)),
    pipelined=st.booleans(),
    tp=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_a_producer_holds_nothing_after_any_interleaving_of_prefills_and_aborts(
    mode: str, pipelined: bool, tp: int, data: st.DataObject
) -> None:
    # Each step: requests arrive, one may be aborted mid-prefill (prompts
    # take two or more steps of 64 tokens), and the inner connector reports
    # any finished prefill's KV sent. Then all are sent. Pipelined: async
    # scheduling, each step's output a step late.
    cls = (ASYNC_MODES if pipelined else MODES)[mode]
    sched = engine("kv_producer", tp, cls=cls, step_tokens=64)
    steps = Steps(
        sched, [stub_worker() for _ in range(tp)], KVOutputAggregator(tp), pipelined
    )
    workers = steps.workers
    added = 0
    # A connector reports each send once; pipelined, a request whose send
    # was reported stays in the scheduler until that step's output arrives.
    reported: set[str] = set()

    def sent(req_ids: set[str]) -> dict[int, KVConnectorTransferResults]:
        reported.update(req_ids)
        return {
            rank: KVConnectorTransferResults(finished_sending=set(req_ids))
            for rank in range(tp)
        }

    def holding_kv() -> list[str]:
        """Finished prefills whose KV waits for its send."""
        return sorted(
            r
            for r, q in sched.requests.items()
            if q.is_finished() and r not in reported
        )

    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            sched.add_request(
                request(f"p{added}", N, {"do_remote_decode": True}, max_tokens=1)
            )
            added += 1
        _maybe_abort_one(sched, data)
        now = {r for r in holding_kv() if data.draw(st.booleans(), label=f"send {r}")}
        steps.step(sent(now))
    for _ in range(40):  # 16 prompts of 100 tokens take 25 steps
        steps.step(sent(set(holding_kv())))
    steps.drain()

    assert not sched.requests
    assert held(sched, workers) == [set()] * (1 + tp)
