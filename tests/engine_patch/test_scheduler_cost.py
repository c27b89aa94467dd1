"""KVChecksumScheduler: an idle step costs the same whatever is in flight
(counted in operations, not timed)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import numpy as np
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

from engine_patch.payload import KV_TRANSFER_PARAMS_KEY, KVChecksumPayload
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


def test_a_pending_load_keeps_few_objects_for_the_cyclic_collector() -> None:
    # Each object a pending load keeps, and the collector tracks, brings the
    # scheduler's next collection nearer; a collection walks the engine's
    # young objects (long prompts' token lists). A shared set stands for "no
    # gaps" and the producer's checksums are arrays over bytes, not
    # memoryviews of the payload.
    scheduler = make_scheduler(kv_config(full()))
    payload = KVChecksumPayload(1, 32, {0: (0, 16, 0, np.arange(2, dtype=np.uint64))})
    params = {KV_TRANSFER_PARAMS_KEY: payload.to_base64()}
    loads = [consumer_request(req_id, 32, params) for req_id in ("a", "b")]
    for i, recv in enumerate(loads):
        scheduler.on_new_request(recv)
        recv.num_computed_tokens = 32
        blocks = FakeBlocks.of([2 * i + 1, 2 * i + 2])
        # The second load of the step: the scheduler's dicts are there.
        gc.collect()
        gc.disable()
        try:
            scheduler.add_recv(recv, blocks, 0)
            kept = gc.get_objects(0)
        finally:
            gc.enable()
    assert scheduler.build_checksum_meta() is not None
    assert not [o for o in kept if isinstance(o, (memoryview, frozenset))]
    # PendingChecksums; its blocks, their group's (start, ids) and the ids;
    # the payload, its group's checksums (an untracked array).
    assert len(kept) <= 8, "\n".join(repr(o)[:70] for o in kept)
