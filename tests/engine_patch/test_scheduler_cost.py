"""KVChecksumScheduler: an idle step costs the same whatever is in flight
(counted in operations, not timed)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnectorOutput,
    FakeKVCacheManager,
    consumer_request,
    producer_request,
)
from scheduler_harness import (
    full,
    kv_config,
    make_scheduler,
)

from engine_patch.scheduler import KVChecksumScheduler


def count_ops(fn: Callable[[], object]) -> int:
    """Python lines ``fn`` runs and the functions it calls, Python or C
    (``sys.settrace``, ``sys.setprofile``): a loop counts every turn."""
    ops = 0

    def trace(frame: object, event: str, arg: object) -> object:
        nonlocal ops
        ops += 1
        return trace

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal ops
        if event == "c_call":
            ops += 1

    sys.settrace(trace)  # type: ignore[arg-type]
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return ops


def scheduler_with_pending(num_requests: int) -> KVChecksumScheduler:
    """A scheduler with ``num_requests`` loads and as many sends in flight:
    scheduled, taken by the workers, not reported yet."""
    scheduler = make_scheduler(kv_config(full()))
    manager = FakeKVCacheManager()
    for i in range(num_requests):
        recv = consumer_request(f"c{i}", 32)
        scheduler.on_new_request(recv)
        recv.num_computed_tokens = 32
        scheduler.add_recv(recv, FakeBlocks.of([2 * i + 1, 2 * i + 2]), 0)
        send = producer_request(f"p{i}", 32)
        manager.by_request[send.request_id] = FakeBlocks.of([2 * i + 1, 2 * i + 2])
        send.num_computed_tokens = 32
        scheduler.add_send(send, 32, manager)
    assert scheduler.build_checksum_meta() is not None
    return scheduler


@pytest.mark.parametrize(
    "output",
    [None, FakeConnectorOutput(), FakeConnectorOutput([], set())],
    ids=["no output", "empty fields", "nothing reported"],
)
def test_a_step_with_nothing_scheduled_or_reported_costs_the_same_whatever_is_pending(
    output: FakeConnectorOutput | None,
) -> None:
    # Engines call build_checksum_meta and update_from_output every step;
    # with nothing to checksum or verify they must not touch the requests in
    # flight (counted in operations, not timed).
    def idle_step(scheduler: KVChecksumScheduler) -> Callable[[], None]:
        def step() -> None:
            assert scheduler.build_checksum_meta() is None
            assert scheduler.update_from_output(output, set()) == set()

        return step

    one, many = scheduler_with_pending(1), scheduler_with_pending(500)
    idle_step(one)()
    idle_step(many)()
    assert count_ops(idle_step(many)) == count_ops(idle_step(one))
    assert count_ops(idle_step(one)) <= 40
