"""KVGuard's scheduler classes in vLLM 0.32's real scheduler (no workers, no
model: each step's worker output is made up here): a load's verdict comes
in the ``update_from_output`` that reports the load finished.

Each load here is 100 tokens (4 blocks of 32) from a producer whose
checksums the consumer's workers either match or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from engine_steps import (
    Workers,
    block_checksums,
    consume,
    consumer_params,
    finished,
    kvguard_counts,
    kvguard_metadata,
    make_scheduler,
    produce,
    request,
    runner_output,
    scheduled_ids,
    step,
    vllm_config,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from engine_patch.vllm.host import UnsupportedKVCacheError
from engine_patch.vllm.scheduler import KVGuardAsyncScheduler, KVGuardScheduler

pytestmark = pytest.mark.vllm

NUM_TOKENS = 100
CHECKSUMS = block_checksums(NUM_TOKENS)


def corrupted() -> np.ndarray:
    """The consumer's checksums of a load with one bad block."""
    values = CHECKSUMS.copy()
    values[2] ^= np.uint64(1 << 40)
    return values


def start_load(scheduler: Scheduler, req_id: str = "r1") -> SchedulerOutput:
    """Add a consumer request and run the step that starts its load; that
    step's output."""
    scheduler.add_request(
        request(req_id, NUM_TOKENS, consumer_params(NUM_TOKENS, CHECKSUMS))
    )
    output, _ = step(scheduler)
    assert not scheduled_ids(output)
    assert scheduler.requests[req_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return output


def load_finishes(loaded: np.ndarray, req_id: str = "r1") -> Workers:
    """The workers' output of the step in which the load finishes."""
    return Workers(finished_recving={req_id}, checksums={req_id: loaded})


@pytest.fixture
def mode_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    # KVGuard logs through vLLM's handlers, not the root logger's.
    logger = logging.getLogger("kvguard.engine_patch.vllm")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, "kvguard.engine_patch.vllm")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("cls", [KVGuardScheduler, KVGuardAsyncScheduler])
def test_the_scheduler_classes_subclass_vllms(cls: type[Scheduler]) -> None:
    assert issubclass(KVGuardScheduler, Scheduler)
    assert issubclass(KVGuardAsyncScheduler, AsyncScheduler)
    scheduler = make_scheduler(cls, vllm_config("kv_consumer"))
    output = scheduler.schedule()
    # The workers release finished loads at once.
    assert kvguard_metadata(output).hold_loads is False


def test_a_null_block_other_than_block_0_is_refused_at_startup() -> None:
    # Block ids are read as vLLM lists them for its workers, the null block
    # (out of a sliding window) by its id: another id would be a KV block.
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    side = scheduler.connector._scheduler
    manager = SimpleNamespace(
        block_pool=SimpleNamespace(null_block=SimpleNamespace(block_id=7))
    )
    with pytest.raises(UnsupportedKVCacheError, match="null block is block 7"):
        side.bind_kv_cache_manager(manager)


def test_with_the_scheduler_class_a_corrupted_load_fails_in_the_step_reporting_it() -> (
    None
):
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    start_load(scheduler)
    _, outputs = step(scheduler, load_finishes(corrupted()))
    # vLLM's kv_load_failure_policy "fail": the request ends with an error in
    # this very step's outputs.
    assert finished(outputs) == {"r1": FinishReason.ERROR}
    assert "r1" not in scheduler.requests
    counts = kvguard_counts(outputs)
    assert counts["mismatch"] == 1
    assert counts["failed_loads"] == 1
    assert "KV checksum mismatch" in counts["failed_requests"]["r1"]


def test_with_the_scheduler_class_a_clean_load_is_scheduled_in_the_next_step() -> None:
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    start_load(scheduler)
    _, outputs = step(scheduler, load_finishes(CHECKSUMS))
    assert not finished(outputs)
    # Verified once, though update_connector_output saw the same output too.
    assert kvguard_counts(outputs)["verified"] == 1
    output, outputs = step(scheduler)
    assert scheduled_ids(output) == {"r1"}
    (token,) = [o.new_token_ids for eco in outputs.values() for o in eco.outputs]
    assert token


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_a_load_after_a_local_prefix_hit_is_verified_from_its_first_loaded_block(
    corrupt: bool,
) -> None:
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    prompt = [2 + i % 400 for i in range(NUM_TOKENS)]
    # A local request caches the prompt's first two blocks (64 tokens).
    scheduler.add_request(request("local", 70, None, max_tokens=1, prompt=prompt))
    while "local" in scheduler.requests:
        step(scheduler)
    params = consumer_params(NUM_TOKENS, CHECKSUMS)
    scheduler.add_request(request("r1", NUM_TOKENS, params, prompt=prompt))
    step(scheduler)
    # The workers checksum what they loaded: blocks 2 and 3.
    loaded = (corrupted() if corrupt else CHECKSUMS)[2:]
    workers = Workers(
        finished_recving={"r1"}, checksums={"r1": loaded}, starts={"r1": 2}
    )
    _, outputs = step(scheduler, workers)
    counts = kvguard_counts(outputs)
    assert (counts["verified"], counts["mismatch"]) == (int(not corrupt), int(corrupt))
    assert not counts["unverified"]


def test_with_the_scheduler_class_a_failed_transfer_is_vllms_failure_not_kvguards() -> (
    None
):
    scheduler = make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    start_load(scheduler)
    failed = Workers(finished_recving={"r1"}, failed_recving={"r1"})
    _, outputs = step(scheduler, failed)
    assert finished(outputs) == {"r1": FinishReason.ERROR}
    counts = kvguard_counts(outputs)
    # Nothing to verify: not a mismatch, nor a load KVGuard failed.
    assert not counts.get("mismatch") and not counts.get("unverified"), counts
    assert "r1" not in counts.get("failed_requests", {}), counts


def test_with_the_scheduler_class_recompute_reschedules_the_whole_prompt() -> None:
    config = vllm_config("kv_consumer", policy="recompute")
    scheduler = make_scheduler(KVGuardScheduler, config)
    start_load(scheduler)
    _, outputs = step(scheduler, load_finishes(corrupted()))
    assert not finished(outputs)
    assert kvguard_counts(outputs)["failed_loads"] == 1
    output, _ = step(scheduler)
    # Nothing of the bad load is kept: the prompt is computed locally.
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS}


def test_the_async_scheduler_class_fails_a_corrupted_load_in_its_step() -> None:
    scheduler = make_scheduler(KVGuardAsyncScheduler, vllm_config("kv_consumer"))
    scheduler.add_request(
        request("bad", NUM_TOKENS, consumer_params(NUM_TOKENS, CHECKSUMS))
    )
    scheduler.add_request(
        request("good", NUM_TOKENS, consumer_params(NUM_TOKENS, CHECKSUMS))
    )
    # Async scheduling: the next step is scheduled before this one's output.
    first = scheduler.schedule()
    second = scheduler.schedule()
    workers = Workers(
        finished_recving={"bad", "good"},
        checksums={"bad": corrupted(), "good": CHECKSUMS},
    )
    outputs = scheduler.update_from_output(
        first, runner_output(first, workers.connector_output())
    )
    assert finished(outputs) == {"bad": FinishReason.ERROR}
    third = scheduler.schedule()
    assert scheduled_ids(third) == {"good"}
    scheduler.update_from_output(second, runner_output(second, None))
    outputs = scheduler.update_from_output(third, runner_output(third, None))
    assert [o.request_id for eco in outputs.values() for o in eco.outputs] == ["good"]


def test_connector_only_the_workers_hold_each_load_for_its_verdict() -> None:
    scheduler = make_scheduler(Scheduler, vllm_config("kv_consumer"))
    assert kvguard_metadata(start_load(scheduler)).hold_loads is True
    # The workers checksum the finished load and hold it back from vLLM.
    _, outputs = step(scheduler, Workers(held={"r1"}, checksums={"r1": corrupted()}))
    assert not finished(outputs)
    # The verdict goes to the workers in the next step's metadata, and they
    # report the load failed: a step later than with the scheduler class.
    output = scheduler.schedule()
    assert kvguard_metadata(output).verdicts == {"r1": True}
    released = Workers(finished_recving={"r1"}, failed_recving={"r1"}, kvguard=False)
    outputs = scheduler.update_from_output(
        output, runner_output(output, released.connector_output())
    )
    assert finished(outputs) == {"r1": FinishReason.ERROR}


def test_connector_only_a_clean_loads_verdict_releases_it() -> None:
    scheduler = make_scheduler(Scheduler, vllm_config("kv_consumer"))
    start_load(scheduler)
    step(scheduler, Workers(held={"r1"}, checksums={"r1": CHECKSUMS}))
    output = scheduler.schedule()
    assert kvguard_metadata(output).verdicts == {"r1": False}


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_the_scheduler_sides_own_seconds_fit_in_its_steps(role: str) -> None:
    scheduler = make_scheduler(KVGuardScheduler, vllm_config(role))
    start = time.perf_counter()
    if role == "kv_producer":
        counts = produce(scheduler, "p", NUM_TOKENS)
    else:
        counts = consume(scheduler, "c", NUM_TOKENS)
    elapsed = time.perf_counter() - start
    assert 0 < counts["scheduler_seconds"] < elapsed


def test_the_connector_logs_its_mode_at_startup(
    mode_logs: pytest.LogCaptureFixture,
) -> None:
    make_scheduler(KVGuardScheduler, vllm_config("kv_consumer"))
    assert "KVGuard mode: same-step verdicts" in mode_logs.text
    assert "connector-only" not in mode_logs.text
    mode_logs.clear()
    make_scheduler(Scheduler, vllm_config("kv_consumer"))
    assert "KVGuard mode: connector-only" in mode_logs.text


def test_the_scheduler_class_without_kvguard_schedules_as_vllm(
    mode_logs: pytest.LogCaptureFixture,
) -> None:
    scheduler = make_scheduler(
        KVGuardScheduler, vllm_config("kv_consumer", connector="NixlConnector")
    )
    assert "has no KVGuardConnector" in mode_logs.text
    scheduler.add_request(
        request("r1", NUM_TOKENS, consumer_params(NUM_TOKENS, checksums=None))
    )
    step(scheduler)
    step(scheduler, Workers(finished_recving={"r1"}, kvguard=False))
    output, _ = step(scheduler)
    assert scheduled_ids(output) == {"r1"}
