"""KVChecksumScheduler (hand-built worker records, no torch): which requests
it checksums and when, and what each step's workers are asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnector,
    FakeConnectorOutput,
    FakeKVCacheManager,
    FakeRequest,
    FakeWorkers,
    consumer_request,
    producer_request,
    token_values,
)
from scheduler_harness import (
    RNG,
    full,
    kv_config,
    make_scheduler,
)

from engine_patch.config import KVChecksumConfig
from engine_patch.host import NULL_BLOCK_ID
from engine_patch.kv_cache import (
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)
from engine_patch.scheduler import KVChecksumScheduler


def test_the_scheduler_does_not_import_torch() -> None:
    # It runs in vLLM's scheduler process and in the proxy-side fake engine
    # without torch; numpy only.
    code = "import sys, engine_patch.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_create_needs_a_connector_and_checksums_enabled() -> None:
    config = kv_config(full())
    assert KVChecksumScheduler.create(KVChecksumConfig(), config, None) is None
    assert (
        KVChecksumScheduler.create(
            KVChecksumConfig(enabled=False), config, FakeConnector()
        )
        is None
    )
    assert isinstance(
        KVChecksumScheduler.create(KVChecksumConfig(), config, FakeConnector()),
        KVChecksumScheduler,
    )


def test_fail_closed_is_the_default() -> None:
    # Fail-open is an explicit opt-in (for rollouts): by default an
    # unverified load fails.
    assert KVChecksumConfig().fail_closed
    scheduler = KVChecksumScheduler(
        KVChecksumConfig(), kv_config(full()), FakeConnector()
    )
    assert scheduler.fail_closed
    req = consumer_request("c", 16)
    scheduler.on_new_request(req)
    req.num_computed_tokens = 16
    scheduler.add_recv(req, FakeBlocks.of([1]), 0)
    scheduler.build_checksum_meta()
    records = FakeWorkers().report("c", {0: (0, token_values(RNG, 1))})
    assert scheduler.update_from_output(FakeConnectorOutput(records, {"c"}), set()) == {
        "c"
    }


def test_producer_is_checksummed_only_in_the_step_that_finishes_its_prompt() -> None:
    scheduler = make_scheduler(kv_config(full()))
    manager = FakeKVCacheManager({"p": FakeBlocks.of([1, 2, 3])})
    req = producer_request("p", 40)
    # A first chunk of 32 tokens does not finish the prompt.
    req.num_computed_tokens = 32
    scheduler.add_send(req, 32, manager)
    assert scheduler.build_checksum_meta() is None
    # The second chunk does.
    req.num_computed_tokens = 40
    scheduler.add_send(req, 8, manager)
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_send["p"].num_tokens == 40
    assert scheduled.reqs_to_send["p"].groups == {0: (0, [1, 2, 3])}
    # A decode step after it does not, and the meta was reset.
    req.num_computed_tokens = 41
    scheduler.add_send(req, 1, manager)
    assert scheduler.build_checksum_meta() is None


def test_requests_without_do_remote_decode_are_not_checksummed() -> None:
    scheduler = make_scheduler(kv_config(full()))
    manager = FakeKVCacheManager({"r": FakeBlocks.of([1])})
    for params in (None, {}, {"do_remote_decode": False}):
        req = FakeRequest("r", params, num_computed_tokens=10, num_prompt_tokens=10)
        scheduler.add_send(req, 10, manager)
    assert scheduler.build_checksum_meta() is None


def test_a_consumer_expects_its_load_from_its_producer_until_the_load_starts() -> None:
    scheduler = make_scheduler(kv_config(full()))
    consumer = consumer_request("c", 32)
    reloading = FakeRequest("r", {"do_remote_prefill": True, "do_remote_decode": True})
    for req in (consumer, producer_request("p", 32), reloading):
        scheduler.on_new_request(req)
    assert scheduler.expects_load(consumer)
    assert not scheduler.expects_load(producer_request("p", 32))
    assert not scheduler.expects_load(reloading)
    consumer.num_computed_tokens = 32
    scheduler.add_recv(consumer, FakeBlocks.of([1, 2]), 0)
    assert not scheduler.expects_load(consumer)


def test_blocks_leave_out_leading_nulls_and_groups_with_a_gap() -> None:
    config = kv_config(full(), SlidingWindowSpec(16, sliding_window=20), full())
    scheduler = make_scheduler(config)
    req = producer_request("p", 80)
    req.num_computed_tokens = 80
    blocks = FakeBlocks.of(
        [1, 2, 3, 4, 5],
        # Out of the window: null; the connector transfers the last 3 blocks.
        [None, 6, 7, 8, 9],
        # A null block after a non-null one: not a run, left out.
        [10, None, 11, 12, 13],
    )
    scheduler.add_send(req, 80, FakeKVCacheManager({"p": blocks}))
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_send["p"].groups == {
        0: (0, [1, 2, 3, 4, 5]),
        1: (2, [7, 8, 9]),
    }


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_hosts_block_ids_are_read_as_its_blocks(as_ids: bool) -> None:
    # vLLM's scheduler output lists a new request's block ids, the null
    # block as id 0: add_send reads them instead of the manager's blocks,
    # with the same result.
    config = kv_config(
        full(),
        SlidingWindowSpec(16, sliding_window=20),
        full(),
        MambaSpec(block_size=64),
    )
    scheduler = make_scheduler(config)
    req = producer_request("p", 80)
    req.num_computed_tokens = 80
    groups = (
        [1, 2, 3, 4, 5],
        [None, 6, 7, 8, 9],
        [10, None, 11, 12, 13],
        [None, 14],
    )
    blocks = FakeBlocks.of(*groups)
    ids = [[NULL_BLOCK_ID if i is None else i for i in group] for group in groups]
    if as_ids:
        scheduler.add_send(req, 80, FakeKVCacheManager({}), ids)
    else:
        scheduler.add_send(req, 80, FakeKVCacheManager({"p": blocks}))
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_send["p"].groups == {
        0: (0, [1, 2, 3, 4, 5]),
        1: (2, [7, 8, 9]),
        3: (0, [14]),
    }
    # The scheduler keeps copies: the host may extend its lists later.
    ids[0].append(99)
    assert scheduled.reqs_to_send["p"].groups[0] == (0, [1, 2, 3, 4, 5])


def test_mamba_state_is_the_last_block_before_speculative_ones_at_position_0() -> None:
    config = kv_config(full(), MambaSpec(block_size=64, num_speculative_blocks=2))
    scheduler = make_scheduler(config)
    req = producer_request("p", 20)
    req.num_computed_tokens = 20
    blocks = FakeBlocks.of([1, 2], [None, 7, 8, 9])
    scheduler.add_send(req, 20, FakeKVCacheManager({"p": blocks}))
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_send["p"].groups == {0: (0, [1, 2]), 1: (0, [7])}


def test_only_transfer_groups_are_checksummed() -> None:
    config = KVCacheConfig(
        [KVCacheGroup(full()), KVCacheGroup(full())], transfer_group_ids=(1,)
    )
    scheduler = make_scheduler(config)
    req = producer_request("p", 16)
    req.num_computed_tokens = 16
    scheduler.add_send(req, 16, FakeKVCacheManager({"p": FakeBlocks.of([1], [2])}))
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_send["p"].groups == {1: (0, [2])}


def test_a_config_with_no_transfer_group_checksums_nothing() -> None:
    # vLLM's meaning of an empty transfer_group_ids (fail-open, every group
    # of a kind KVGuard cannot checksum): none, not every group.
    config = KVCacheConfig([KVCacheGroup(full())], transfer_group_ids=())
    assert config.transfer_group_ids == ()
    assert KVCacheConfig([KVCacheGroup(full())]).transfer_group_ids == (0,)
    scheduler = make_scheduler(config)
    req = producer_request("p", 16)
    req.num_computed_tokens = 16
    scheduler.add_send(req, 16, FakeKVCacheManager({"p": FakeBlocks.of([1])}))
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is None or not scheduled.reqs_to_send["p"].groups
