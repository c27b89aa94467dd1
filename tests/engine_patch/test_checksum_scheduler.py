"""KVChecksumScheduler with hand-built worker records (no torch): what it
schedules, what a producer sends, and how a consumer's load is verified,
mismatched or left unverified."""

from __future__ import annotations

import base64
import collections
import logging
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_host_fakes import (
    FakeBlocks,
    FakeConnector,
    FakeConnectorOutput,
    FakeKVCacheManager,
    FakeRequest,
    FakeWorkers,
    block_sums,
    consumer_request,
    producer_request,
    scheduled_values,
    token_values,
)

from engine_patch import log
from engine_patch.config import KVChecksumConfig
from engine_patch.hashing import block_checksum_tags
from engine_patch.host import CacheHitSource, FinishReason
from engine_patch.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    sliding_window_transfer_blocks,
)
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY, KVChecksumPayload
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.types import KVChecksumGroup, KVChecksumRecord
from engine_patch.verify import (
    Unverified,
    UnverifiedReason,
    chunk_sums,
    sum_replicas,
)

R = UnverifiedReason


def kv_config(*specs: KVCacheSpec, hash_block_size: int | None = None) -> KVCacheConfig:
    return KVCacheConfig(
        [KVCacheGroup(spec) for spec in specs], hash_block_size=hash_block_size
    )


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size)


def make_scheduler(
    config: KVCacheConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    fail_closed: bool = True,
    connector: FakeConnector | None = None,
) -> KVChecksumScheduler:
    return KVChecksumScheduler(
        KVChecksumConfig(tp_size=tp, pp_size=pp, fail_closed=fail_closed),
        config,
        connector or FakeConnector(),
    )


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(log, "_warned", set())


@dataclass
class Producer:
    """A producer engine's scheduler and workers, one request at a time."""

    config: KVCacheConfig
    workers: FakeWorkers = field(default_factory=FakeWorkers)

    def __post_init__(self) -> None:
        self.scheduler = make_scheduler(
            self.config, tp=self.workers.tp, pp=self.workers.pp
        )
        self.manager = FakeKVCacheManager()

    def prefill(
        self,
        req: FakeRequest,
        blocks: FakeBlocks,
        tokens: Mapping[int, np.ndarray],
        num_scheduled: int | None = None,
    ) -> None:
        """Schedule the step that finishes the prompt; the workers report."""
        self.manager.by_request[req.request_id] = blocks
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.add_send(
            req, num_scheduled or req.num_prompt_tokens, self.manager
        )
        scheduled = self.scheduler.build_checksum_meta()
        assert scheduled is not None
        values = scheduled_values(
            scheduled.reqs_to_send[req.request_id], tokens, self.config
        )
        records = self.workers.report(req.request_id, values)
        assert not self.scheduler.update_from_output(
            FakeConnectorOutput(records), set()
        )

    def finish(
        self, req: FakeRequest, reason: FinishReason = FinishReason.STOP
    ) -> str | None:
        req.finish_reason = reason
        params: dict[str, object] = {}
        self.scheduler.request_finished(req, params)
        encoded = params.get(KV_TRANSFER_PARAMS_KEY)
        assert encoded is None or isinstance(encoded, str)
        return encoded

    def send(
        self, num_tokens: int, blocks: FakeBlocks, tokens: Mapping[int, np.ndarray]
    ) -> str:
        """A whole producer request: its encoded payload."""
        req = producer_request("req", num_tokens)
        self.prefill(req, blocks, tokens)
        encoded = self.finish(req)
        assert encoded is not None
        return encoded


@dataclass
class Consumer:
    """A consumer engine's scheduler and workers."""

    config: KVCacheConfig
    workers: FakeWorkers = field(default_factory=FakeWorkers)
    fail_closed: bool = True
    connector: FakeConnector = field(default_factory=FakeConnector)

    def __post_init__(self) -> None:
        self.scheduler = make_scheduler(
            self.config,
            tp=self.workers.tp,
            pp=self.workers.pp,
            fail_closed=self.fail_closed,
            connector=self.connector,
        )

    def start_load(
        self, req: FakeRequest, blocks: FakeBlocks, num_local_tokens: int = 0
    ) -> None:
        self.scheduler.on_new_request(req)
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.add_recv(req, blocks, num_local_tokens)

    def load(
        self,
        req: FakeRequest,
        blocks: FakeBlocks,
        tokens: Mapping[int, np.ndarray],
        *,
        num_local_tokens: int = 0,
        received: bytes | None = None,
        ranks: list[tuple[int, int]] | None = None,
    ) -> set[str]:
        """Load the request's KV (``tokens``: what the blocks hold after it),
        the workers report, and the load finishes: the failed loads."""
        self.start_load(req, blocks, num_local_tokens)
        scheduled = self.scheduler.build_checksum_meta()
        assert scheduled is not None
        values = scheduled_values(
            scheduled.reqs_to_recv[req.request_id], tokens, self.config
        )
        records = self.workers.report(req.request_id, values, ranks=ranks)
        if received is not None:
            records[0].received[req.request_id] = received
        return self.scheduler.update_from_output(
            FakeConnectorOutput(records, {req.request_id}), set()
        )

    @property
    def stats(self):  # type: ignore[no-untyped-def]
        return self.scheduler.stats


def corrupt(tokens: np.ndarray, token: int) -> np.ndarray:
    bad = tokens.copy()
    bad[token] ^= np.uint64(1 << 63)
    return bad


RNG = np.random.default_rng(1234)


# --- Creation and scheduling ---------------------------------------------------


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


# --- Producer sends ---------------------------------------------------------


def test_producer_sends_the_sum_of_every_workers_checksums() -> None:
    config = kv_config(full(16), full(32))
    workers = FakeWorkers(tp=2, pp=2, fingerprints={0: 11, 1: 22})
    producer = Producer(config, workers)
    tokens = {0: token_values(RNG, 70), 1: token_values(RNG, 70)}
    req = producer_request("p", 70)
    producer.prefill(req, FakeBlocks.of([5, 6, 7, 8, 9], [3, 4, 5]), tokens)
    encoded = producer.finish(req)
    assert encoded is not None
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    assert payload.tp_size == 2
    assert payload.num_tokens == 70
    fp0, bs0, start0, values0 = payload.groups[0]
    assert (fp0, bs0, start0) == (11, 16, 0)
    np.testing.assert_array_equal(values0, block_sums(tokens[0], 16, 0, 5, 70))
    fp1, bs1, start1, values1 = payload.groups[1]
    assert (fp1, bs1, start1) == (22, 32, 0)
    np.testing.assert_array_equal(values1, block_sums(tokens[1], 32, 0, 3, 70))
    # Connectors that send checksums in their own messages get the same bytes.
    assert producer.scheduler.take_kv_checksums_to_send() == {
        "p": base64.b64decode(encoded)
    }
    assert producer.scheduler.take_kv_checksums_to_send() == {}
    assert producer.scheduler.stats.sent == 1


def test_producer_without_returned_params_still_gives_the_connector_its_checksums() -> (
    None
):
    producer = Producer(kv_config(full()))
    req = producer_request("p", 16)
    producer.prefill(req, FakeBlocks.of([1]), {0: token_values(RNG, 16)})
    req.finish_reason = FinishReason.LENGTH
    producer.scheduler.request_finished(req, None)
    assert set(producer.scheduler.take_kv_checksums_to_send()) == {"p"}


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.ERROR])
def test_aborted_or_failed_producers_send_nothing(reason: FinishReason) -> None:
    producer = Producer(kv_config(full()))
    req = producer_request("p", 16)
    producer.prefill(req, FakeBlocks.of([1]), {0: token_values(RNG, 16)})
    assert producer.finish(req, reason) is None
    assert producer.scheduler.take_kv_checksums_to_send() == {}
    assert producer.scheduler.stats.sent == 0
    assert not producer.scheduler.stats.not_sent


def test_producer_finished_before_its_prompt_sends_nothing() -> None:
    producer = Producer(kv_config(full()))
    assert producer.finish(producer_request("p", 16)) is None
    assert producer.scheduler.take_kv_checksums_to_send() == {}


def test_producer_missing_a_workers_report_sends_no_checksums(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer = Producer(kv_config(full()), FakeWorkers(tp=2))
    scheduler = producer.scheduler
    req = producer_request("p", 16)
    producer.manager.by_request["p"] = FakeBlocks.of([1])
    req.num_computed_tokens = 16
    scheduler.add_send(req, 16, producer.manager)
    scheduled = scheduler.build_checksum_meta()
    assert scheduled is not None
    values = scheduled_values(
        scheduled.reqs_to_send["p"], {0: token_values(RNG, 16)}, producer.config
    )
    records = producer.workers.report("p", values, ranks=[(0, 1)])
    scheduler.update_from_output(FakeConnectorOutput(records), set())
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        assert producer.finish(req) is None
    assert scheduler.stats.not_sent == {R.INCOMPLETE: 1}
    assert f"KV checksums not sent: {R.INCOMPLETE}." in caplog.messages
    assert "1 of 2 workers reported" in caplog.text


def test_preempted_producers_re_prefill_replaces_the_earlier_checksums() -> None:
    config = kv_config(full())
    producer = Producer(config)
    req = producer_request("p", 40)
    first = {0: token_values(RNG, 40)}
    producer.prefill(req, FakeBlocks.of([1, 2, 3]), first)
    # Preempted, then prefilled again into other blocks, with other KV.
    second = {0: token_values(RNG, 40)}
    producer.prefill(req, FakeBlocks.of([7, 8, 9]), second)
    encoded = producer.finish(req)
    assert encoded is not None
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    np.testing.assert_array_equal(
        payload.groups[0][3], block_sums(second[0], 16, 0, 3, 40)
    )


def test_a_stale_report_of_other_blocks_leaves_the_send_without_checksums() -> None:
    producer = Producer(kv_config(full()))
    scheduler = producer.scheduler
    req = producer_request("p", 40)
    producer.manager.by_request["p"] = FakeBlocks.of([1, 2, 3])
    req.num_computed_tokens = 40
    scheduler.add_send(req, 40, producer.manager)
    scheduler.build_checksum_meta()
    # The worker's report is of two blocks, e.g. an earlier prefill's.
    records = producer.workers.report("p", {0: (0, np.zeros(2, dtype=np.uint64))})
    scheduler.update_from_output(FakeConnectorOutput(records), set())
    assert producer.finish(req) is None
    assert scheduler.stats.not_sent == {R.OTHER_BLOCKS: 1}


def test_producer_skipped_groups_and_groups_no_worker_reports_are_not_sent() -> None:
    config = kv_config(full(), full(), full())
    # Group 2 holds only drafter layers: the workers have none of them.
    workers = FakeWorkers(fingerprints={0: 1, 1: 2}, skipped=frozenset({1}))
    producer = Producer(config, workers)
    req = producer_request("p", 16)
    producer.manager.by_request["p"] = FakeBlocks.of([1], [2], [3])
    req.num_computed_tokens = 16
    producer.scheduler.add_send(req, 16, producer.manager)
    scheduled = producer.scheduler.build_checksum_meta()
    assert scheduled is not None
    values = scheduled_values(
        scheduled.reqs_to_send["p"],
        {g: token_values(RNG, 16) for g in range(3)},
        config,
    )
    del values[2]
    producer.scheduler.update_from_output(
        FakeConnectorOutput(workers.report("p", values)), set()
    )
    encoded = producer.finish(req)
    assert encoded is not None
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    assert set(payload.groups) == {0}


# --- Consumer loads -------------------------------------------------------------


def p2p_load(
    producer_config: KVCacheConfig,
    consumer_config: KVCacheConfig,
    num_tokens: int,
    producer_blocks: FakeBlocks,
    consumer_blocks: FakeBlocks,
    *,
    producer_workers: FakeWorkers | None = None,
    consumer_workers: FakeWorkers | None = None,
    bad_tokens: tuple[int, ...] = (),
    num_local_tokens: int = 0,
    fail_closed: bool = True,
) -> tuple[Consumer, set[str]]:
    """A producer prefills random KV; the consumer loads it, with a bit
    flipped in each of ``bad_tokens`` of group 0, and verifies it."""
    tokens = {
        g: token_values(RNG, num_tokens)
        for g in range(len(producer_config.kv_cache_groups))
    }
    producer = Producer(producer_config, producer_workers or FakeWorkers())
    encoded = producer.send(num_tokens, producer_blocks, tokens)
    consumer = Consumer(
        consumer_config, consumer_workers or FakeWorkers(), fail_closed=fail_closed
    )
    req = consumer_request("req", num_tokens, {KV_TRANSFER_PARAMS_KEY: encoded})
    loaded = dict(tokens)
    for token in bad_tokens:
        loaded[0] = corrupt(loaded[0], token)
    failed = consumer.load(
        req, consumer_blocks, loaded, num_local_tokens=num_local_tokens
    )
    return consumer, failed


@pytest.mark.parametrize(
    ("producer_tp", "producer_pp", "consumer_tp", "consumer_pp"),
    [
        (1, 1, 1, 1),
        (2, 1, 1, 1),
        (1, 1, 2, 1),
        (1, 2, 1, 1),
        (1, 1, 2, 2),
        (4, 2, 8, 1),
    ],
)
def test_a_correct_load_verifies_across_tp_and_pp(
    producer_tp: int, producer_pp: int, consumer_tp: int, consumer_pp: int
) -> None:
    config = kv_config(full())
    consumer, failed = p2p_load(
        config,
        config,
        50,
        FakeBlocks.of([1, 2, 3, 4]),
        FakeBlocks.of([9, 8, 7, 6]),
        producer_workers=FakeWorkers(tp=producer_tp, pp=producer_pp),
        consumer_workers=FakeWorkers(tp=consumer_tp, pp=consumer_pp),
    )
    assert failed == set()
    assert consumer.stats.verified == 1
    assert consumer.stats.mismatch == 0
    assert not consumer.stats.unverified


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), [(16, 32), (32, 16), (16, 64)])
@pytest.mark.parametrize("num_tokens", [64, 70, 100, 7])
def test_different_block_sizes_compare_chunk_sums(
    producer_bs: int, consumer_bs: int, num_tokens: int
) -> None:
    def blocks(block_size: int, first_id: int) -> FakeBlocks:
        count = -(-num_tokens // block_size)
        return FakeBlocks.of(list(range(first_id, first_id + count)))

    consumer, failed = p2p_load(
        kv_config(full(producer_bs)),
        kv_config(full(consumer_bs)),
        num_tokens,
        blocks(producer_bs, 1),
        blocks(consumer_bs, 20),
    )
    assert failed == set()
    assert consumer.stats.verified == 1


@pytest.mark.parametrize(
    ("producer_bs", "consumer_bs", "bad_token", "bad_positions"),
    [
        # The consumer's position of the 32-token chunk holding the token.
        (16, 32, 20, [0]),
        (16, 32, 69, [2]),
        # Both 16-token consumer blocks of the producer's 32-token block.
        (32, 16, 40, [2, 3]),
        (32, 16, 68, [4]),  # The last, partial one.
        (16, 16, 33, [2]),
    ],
)
def test_a_corrupted_load_fails_with_its_block_positions(
    producer_bs: int,
    consumer_bs: int,
    bad_token: int,
    bad_positions: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    num_tokens = 70
    tokens = {0: token_values(RNG, num_tokens)}
    producer = Producer(kv_config(full(producer_bs)))
    encoded = producer.send(
        num_tokens,
        FakeBlocks.of(list(range(1, 1 + -(-num_tokens // producer_bs)))),
        tokens,
    )
    consumer = Consumer(kv_config(full(consumer_bs)))
    req = consumer_request("c", num_tokens, {KV_TRANSFER_PARAMS_KEY: encoded})
    with caplog.at_level(logging.ERROR, logger="kvguard.engine_patch.scheduler"):
        failed = consumer.load(
            req,
            FakeBlocks.of(list(range(10, 10 + -(-num_tokens // consumer_bs)))),
            {0: corrupt(tokens[0], bad_token)},
        )
    assert failed == {"c"}
    assert consumer.stats.mismatch == 1
    assert consumer.stats.verified == 0
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert f"request c: group 0 block positions {bad_positions}" in record.message


def test_fail_open_logs_and_counts_a_mismatch_but_lets_the_load_proceed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = {0: token_values(RNG, 40)}
    producer = Producer(kv_config(full()))
    encoded = producer.send(40, FakeBlocks.of([1, 2, 3]), tokens)
    consumer = Consumer(kv_config(full()), fail_closed=False)
    req = consumer_request("c", 40, {KV_TRANSFER_PARAMS_KEY: encoded})
    with caplog.at_level(logging.ERROR, logger="kvguard.engine_patch.scheduler"):
        failed = consumer.load(
            req, FakeBlocks.of([4, 5, 6]), {0: corrupt(tokens[0], 0)}
        )
    assert failed == set()
    assert consumer.stats.mismatch == 1
    assert "group 0 block positions [0]" in caplog.text
    assert "fail-open" in caplog.text


@pytest.mark.parametrize("fail_closed", [True, False], ids=["closed", "open"])
def test_mismatched_loads_are_named_for_the_host_to_keep_out_of_its_prefix_cache(
    fail_closed: bool,
) -> None:
    tokens = {0: token_values(RNG, 40)}
    producer = Producer(kv_config(full()))
    consumer = Consumer(kv_config(full()), fail_closed=fail_closed)
    loads = {"bad": {0: corrupt(tokens[0], 20)}, "good": tokens, "unsent": tokens}
    for req_id, loaded in loads.items():
        req = producer_request(req_id, 40)
        producer.prefill(req, FakeBlocks.of([1, 2, 3]), tokens)
        params = {KV_TRANSFER_PARAMS_KEY: producer.finish(req)}
        if req_id == "unsent":
            params = {}
        consumer.load(
            consumer_request(req_id, 40, params), FakeBlocks.of([4, 5, 6]), loaded
        )
    assert consumer.stats.mismatch == consumer.stats.verified == 1
    assert consumer.stats.unverified == {R.NO_CHECKSUMS: 1}
    # In both modes; under fail-open the request itself goes on.
    assert consumer.scheduler.take_mismatched_loads() == {"bad": {0: [1]}}
    assert consumer.scheduler.take_mismatched_loads() == {}


def test_a_failed_load_says_why_in_its_failure_message() -> None:
    tokens = {0: token_values(RNG, 40)}
    producer = Producer(kv_config(full()))
    encoded = producer.send(40, FakeBlocks.of([1, 2, 3]), tokens)
    consumer = Consumer(kv_config(full()))
    req = consumer_request("c", 40, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.load(req, FakeBlocks.of([4, 5, 6]), {0: corrupt(tokens[0], 20)})
    assert consumer.scheduler.take_load_failures() == {
        "c": "KV checksum mismatch: the KV loaded for request c does not match "
        "the producer's checksums (group 0 block positions [1])"
    }
    # Taken once.
    assert consumer.scheduler.take_load_failures() == {}


def test_an_unverified_load_says_why_in_its_failure_message() -> None:
    consumer = load_with_payload(None)
    assert consumer.scheduler.take_load_failures() == {
        "c": f"KV checksum mismatch: the KV loaded for request c could not be "
        f"verified: {UnverifiedReason.NO_CHECKSUMS}"
    }


def test_fail_open_has_no_load_failures() -> None:
    consumer = load_with_payload(None, fail_closed=False)
    assert consumer.stats.unverified
    assert consumer.scheduler.take_load_failures() == {}


def load_of_other_length(
    sent_tokens: int,
    loaded_tokens: int,
    *,
    bad_token: int | None = None,
    fail_closed: bool = True,
) -> Consumer:
    """The producer checksums ``sent_tokens`` tokens, the consumer loads
    ``loaded_tokens`` (the same KV where both have it)."""
    tokens = token_values(RNG, max(sent_tokens, loaded_tokens))
    producer = Producer(kv_config(full()))
    encoded = producer.send(
        sent_tokens,
        FakeBlocks.of(list(range(1, 1 + -(-sent_tokens // 16)))),
        {0: tokens[:sent_tokens]},
    )
    loaded = tokens[:loaded_tokens]
    if bad_token is not None:
        loaded = corrupt(loaded, bad_token)
    consumer = Consumer(kv_config(full()), fail_closed=fail_closed)
    req = consumer_request("c", loaded_tokens, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.failed = consumer.load(  # type: ignore[attr-defined]
        req, FakeBlocks.of(list(range(20, 20 + -(-loaded_tokens // 16)))), {0: loaded}
    )
    return consumer


@pytest.mark.parametrize("fail_closed", [True, False], ids=["closed", "open"])
def test_loaded_tokens_past_the_payload_are_unverified_naming_the_range(
    fail_closed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Checksums of 40 tokens, a load of 70 corrupted at token 60: block 2
    # holds 8 tokens on the producer, 16 on the consumer; blocks 3 and 4
    # have no producer checksum. Tokens 32..69 are not compared.
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        consumer = load_of_other_length(40, 70, bad_token=60, fail_closed=fail_closed)
    assert consumer.failed == ({"c"} if fail_closed else set())  # type: ignore[attr-defined]
    assert consumer.stats.verified == consumer.stats.mismatch == 0
    assert consumer.stats.unverified == {R.UNCOVERED: 1}
    assert "group 0: tokens [32, 70) of the loaded [0, 70)" in caplog.text
    if fail_closed:
        [message] = consumer.scheduler.take_load_failures().values()
        assert f"{R.UNCOVERED} (group 0: tokens [32, 70)" in message


def test_a_last_block_holding_other_tokens_than_the_producers_is_unverified() -> None:
    # The producer's block 2 holds tokens 32..40, the consumer's 32..39.
    consumer = load_of_other_length(41, 40)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]
    assert consumer.stats.unverified == {R.UNCOVERED: 1}


def test_a_load_of_fewer_tokens_within_the_payloads_blocks_verifies() -> None:
    # Whole blocks on both sides: every loaded token is compared.
    consumer = load_of_other_length(70, 48)
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.stats.verified == 1


def test_a_sliding_window_the_payload_covers_in_part_is_unverified(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 100 tokens. The producer (window 20) sent its last 2 blocks, tokens
    # 64..99; the consumer's window of 48 reads tokens 52..99 (52 for a
    # recomputed last token).
    tokens = {0: token_values(RNG, 100)}
    producer_spec = SlidingWindowSpec(16, sliding_window=20)
    consumer_spec = SlidingWindowSpec(16, sliding_window=48)
    producer = Producer(kv_config(producer_spec))
    encoded = producer.send(
        100, FakeBlocks.of(window_blocks(producer_spec, 100, 1)), tokens
    )
    consumer = Consumer(kv_config(consumer_spec))
    req = consumer_request("c", 100, {KV_TRANSFER_PARAMS_KEY: encoded})
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        failed = consumer.load(
            req, FakeBlocks.of(window_blocks(consumer_spec, 100, 1)), tokens
        )
    assert failed == {"c"}
    assert consumer.stats.unverified == {R.UNCOVERED: 1}
    assert "group 0: tokens [52, 64) of the loaded [52, 100)" in caplog.text


def test_a_group_whose_loaded_blocks_have_a_gap_is_unverified() -> None:
    # Group 1's blocks have a null block after a non-null one: they cannot be
    # checksummed as a run, so its loaded tokens are not compared.
    config = kv_config(full(), full())
    consumer, failed = p2p_load(
        config,
        config,
        40,
        FakeBlocks.of([1, 2, 3], [4, 5, 6]),
        FakeBlocks.of([7, 8, 9], [10, None, 12]),
        producer_workers=FakeWorkers(fingerprints={0: 1, 1: 2}),
        consumer_workers=FakeWorkers(fingerprints={0: 1, 1: 2}),
    )
    assert failed == {"req"}
    assert consumer.stats.unverified == {R.GAP: 1}


def test_a_prefix_hit_verifies_only_the_loaded_blocks() -> None:
    num_tokens = 80
    tokens = {0: token_values(RNG, num_tokens)}
    producer = Producer(kv_config(full()))
    encoded = producer.send(num_tokens, FakeBlocks.of([1, 2, 3, 4, 5]), tokens)
    # The consumer has the first 32 tokens cached: it loads blocks 2..4, and
    # its cached blocks differ from the producer's (they are not loaded).
    loaded = {0: corrupt(corrupt(tokens[0], 0), 31)}
    consumer = Consumer(kv_config(full()))
    req = consumer_request("c", num_tokens, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.start_load(req, FakeBlocks.of([7, 8, 9, 10, 11]), num_local_tokens=32)
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_recv["c"].groups == {0: (2, [9, 10, 11])}
    values = scheduled_values(scheduled.reqs_to_recv["c"], loaded, consumer.config)
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(consumer.workers.report("c", values), {"c"}), set()
    )
    assert failed == set()
    assert consumer.stats.verified == 1


def test_a_corrupted_block_after_a_prefix_hit_is_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="kvguard.engine_patch.scheduler"):
        consumer, failed = p2p_load(
            kv_config(full()),
            kv_config(full(32)),
            80,
            FakeBlocks.of([1, 2, 3, 4, 5]),
            FakeBlocks.of([7, 8, 9]),
            num_local_tokens=32,
            bad_tokens=(70,),
        )
    assert failed == {"req"}
    assert consumer.stats.mismatch == 1
    assert "group 0 block positions [2]" in caplog.text


def test_the_payload_the_connector_received_is_used_without_one_in_params() -> None:
    tokens = {0: token_values(RNG, 30)}
    producer = Producer(kv_config(full()))
    producer.send(30, FakeBlocks.of([1, 2]), tokens)
    [data] = producer.scheduler.take_kv_checksums_to_send().values()
    consumer = Consumer(kv_config(full()))
    failed = consumer.load(
        consumer_request("c", 30), FakeBlocks.of([3, 4]), tokens, received=data
    )
    assert failed == set()
    assert consumer.stats.verified == 1


def test_a_load_that_already_failed_is_not_verified() -> None:
    consumer = Consumer(kv_config(full()))
    req = consumer_request("c", 16)
    consumer.start_load(req, FakeBlocks.of([1]))
    consumer.scheduler.build_checksum_meta()
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput([], {"c"}), skip_req_ids={"c"}
    )
    assert failed == set()
    assert consumer.stats.verified == consumer.stats.mismatch == 0
    assert not consumer.stats.unverified


def test_finished_request_drops_its_pending_load() -> None:
    consumer = Consumer(kv_config(full()))
    req = consumer_request("c", 16)
    consumer.start_load(req, FakeBlocks.of([1]))
    consumer.scheduler.request_finished(req, None)
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput([], {"c"}), set()
    )
    assert failed == set()
    assert not consumer.stats.unverified


def test_a_bidirectional_reload_by_a_producer_is_not_checksummed() -> None:
    consumer = Consumer(kv_config(full()))
    req = FakeRequest(
        "r",
        {"do_remote_prefill": True, "do_remote_decode": True},
        num_prompt_tokens=16,
    )
    consumer.start_load(req, FakeBlocks.of([1]))
    assert consumer.scheduler.build_checksum_meta() is None


def test_a_consumer_load_not_wholly_from_its_producer_is_not_checksummed() -> None:
    connector = FakeConnector(
        sources={CacheHitSource.P2P: 8, CacheHitSource.OFFLOAD: 8}
    )
    consumer = Consumer(kv_config(full()), connector=connector)
    consumer.start_load(consumer_request("c", 16), FakeBlocks.of([1]))
    assert consumer.scheduler.build_checksum_meta() is None


# --- Replicas -------------------------------------------------------------------


def replica_record(
    tp_rank: int, columns: dict[tuple[int, int], np.ndarray], start: int = 0
) -> KVChecksumRecord:
    keys = list(columns)
    return KVChecksumRecord(
        pp_rank=0,
        tp_rank=tp_rank,
        checksums={
            "c": {
                0: KVChecksumGroup(
                    start, keys, np.stack([columns[k] for k in keys], axis=1)
                )
            }
        },
        fingerprints={0: 0xF00D},
    )


def replicated_load(
    head_values: list[np.ndarray], records: list[KVChecksumRecord], tp: int
) -> Consumer:
    """A consumer with TP ``tp`` loads KV whose heads' block checksums the
    producer (TP 1) sent as ``head_values``; its workers report ``records``."""
    total = sum(head_values, start=np.zeros(2, dtype=np.uint64))
    payload = KVChecksumPayload(1, 32, {0: (0xF00D, 16, 0, total)})
    consumer = Consumer(kv_config(full()), FakeWorkers(tp=tp))
    req = consumer_request("c", 32, {KV_TRANSFER_PARAMS_KEY: payload.to_base64()})
    consumer.start_load(req, FakeBlocks.of([5, 6]))
    consumer.scheduler.build_checksum_meta()
    consumer.failed = consumer.scheduler.update_from_output(  # type: ignore[attr-defined]
        FakeConnectorOutput(records, {"c"}), set()
    )
    return consumer


def test_every_replica_of_gqa_heads_is_checked() -> None:
    # TP 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1.
    heads = [token_values(RNG, 2), token_values(RNG, 2)]
    good = [replica_record(r, {(2, r % 2): heads[r // 2]}) for r in range(4)]
    consumer = replicated_load(heads, good, tp=4)
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.stats.verified == 1
    # A corrupted second copy of head 0 (rank 1) is found too.
    bad = [*good]
    bad[1] = replica_record(1, {(2, 1): heads[0] ^ np.uint64(1)})
    consumer = replicated_load(heads, bad, tp=4)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]


def test_layers_with_different_replica_counts_are_checked_copy_by_copy() -> None:
    # Per rank of TP 2: a latent layer on both ranks (R = 2), and one head
    # per rank of a layer with 2 KV heads (R = 1).
    latent, head0, head1 = (token_values(RNG, 2) for _ in range(3))
    records = [
        replica_record(0, {(2, 0): latent, (1, 0): head0}),
        replica_record(1, {(2, 1): latent, (1, 0): head1}),
    ]
    consumer = replicated_load([latent, head0, head1], records, tp=2)
    assert consumer.failed == set()  # type: ignore[attr-defined]
    records[1] = replica_record(1, {(2, 1): latent + np.uint64(1), (1, 0): head1})
    consumer = replicated_load([latent, head0, head1], records, tp=2)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]


def test_sum_replicas_builds_one_check_per_copy() -> None:
    a0, a1, b = (np.array([v], dtype=np.uint64) for v in (1, 2, 40))
    groups = [
        KVChecksumGroup(0, [(2, 0), (1, 0)], np.stack([a0, b], axis=1)),
        KVChecksumGroup(0, [(2, 1)], a1[:, None]),
    ]
    checks = sum_replicas(groups, 1)
    assert [c.tolist() for c in checks] == [[41], [42]]


def test_a_missing_replica_leaves_the_load_unverified() -> None:
    heads = [token_values(RNG, 2), token_values(RNG, 2)]
    # Every rank claims replica 0 of its head: replica 1 is never seen.
    records = [replica_record(r, {(2, 0): heads[r // 2]}) for r in range(4)]
    consumer = replicated_load(heads, records, tp=4)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]
    assert consumer.stats.unverified == {R.MISSING_REPLICA: 1}


def test_sum_replicas_raises_for_a_missing_copy() -> None:
    groups = [KVChecksumGroup(0, [(3, 0), (3, 2)], np.zeros((1, 2), dtype=np.uint64))]
    with pytest.raises(Unverified) as e:
        sum_replicas(groups, 1)
    assert e.value.reason == R.MISSING_REPLICA
    assert e.value.detail == "replica 1 of 3"


# --- Sliding window and Mamba ---------------------------------------------------


def test_a_sliding_window_group_verifies_its_transferred_blocks() -> None:
    # 100 tokens, window 20 in blocks of 16: the last 3 blocks are transferred.
    config = kv_config(full(), SlidingWindowSpec(16, sliding_window=20))
    tokens = {0: token_values(RNG, 100), 1: token_values(RNG, 100)}
    workers = FakeWorkers(fingerprints={0: 1, 1: 2})
    producer = Producer(config, workers)
    encoded = producer.send(
        100, FakeBlocks.of(list(range(1, 8)), [None, None, None, None, 5, 6, 7]), tokens
    )
    consumer = Consumer(config, FakeWorkers(fingerprints={0: 1, 1: 2}))
    req = consumer_request("c", 100, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.start_load(
        req, FakeBlocks.of(list(range(11, 18)), [None, None, 20, 21, 22, 23, 24])
    )
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_recv["c"].groups[1] == (4, [22, 23, 24])
    bad = {0: tokens[0], 1: corrupt(tokens[1], 99)}
    values = scheduled_values(scheduled.reqs_to_recv["c"], bad, config)
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(consumer.workers.report("c", values), {"c"}), set()
    )
    assert failed == {"c"}


def window_blocks(spec: SlidingWindowSpec, num_tokens: int, first_id: int) -> list:
    """A sliding-window group's blocks: null out of the window, then the
    ones P/D connectors transfer."""
    count = -(-num_tokens // spec.block_size)
    keep = min(count, sliding_window_transfer_blocks(spec))
    return [None] * (count - keep) + list(range(first_id, first_id + keep))


def window_load(
    producer_bs: int,
    consumer_bs: int,
    window: int,
    num_tokens: int,
    *,
    bad_token: int | None = None,
) -> Consumer:
    """A model with a full-attention and a sliding-window group: the
    producer sends, the consumer loads (its window's tokens the producer
    did not keep hold garbage: no transfer writes them) and verifies."""
    specs = {
        bs: kv_config(full(bs), SlidingWindowSpec(bs, sliding_window=window))
        for bs in (producer_bs, consumer_bs)
    }
    workers = {0: 1, 1: 2}
    tokens = {g: token_values(RNG, num_tokens) for g in range(2)}

    def blocks(bs: int, first_id: int) -> FakeBlocks:
        count = -(-num_tokens // bs)
        spec = specs[bs].kv_cache_groups[1].kv_cache_spec
        assert isinstance(spec, SlidingWindowSpec)
        return FakeBlocks.of(
            list(range(first_id, first_id + count)),
            window_blocks(spec, num_tokens, first_id + 100),
        )

    producer = Producer(specs[producer_bs], FakeWorkers(fingerprints=workers))
    sent_blocks = blocks(producer_bs, 1)
    encoded = producer.send(num_tokens, sent_blocks, tokens)
    # What the transfer writes: the producer's kept window; the rest of the
    # consumer's kept blocks is garbage.
    first_kept = next(i for i, b in enumerate(sent_blocks.blocks[1]) if not b.is_null)
    loaded = {0: tokens[0], 1: token_values(RNG, num_tokens)}
    kept = slice(first_kept * producer_bs, num_tokens)
    loaded[1][kept] = tokens[1][kept]
    if bad_token is not None:
        loaded[1] = corrupt(loaded[1], bad_token)
    consumer = Consumer(specs[consumer_bs], FakeWorkers(fingerprints=workers))
    req = consumer_request("c", num_tokens, {KV_TRANSFER_PARAMS_KEY: encoded})
    consumer.failed = consumer.load(req, blocks(consumer_bs, 1), loaded)  # type: ignore[attr-defined]
    return consumer


SLIDING_PAIRS = [(32, 16), (16, 32), (64, 16), (16, 64), (32, 64), (64, 32)]


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_PAIRS)
def test_clean_sliding_window_loads_verify_between_block_sizes(
    producer_bs: int, consumer_bs: int
) -> None:
    outcomes = collections.Counter()
    for window in (17, 20, 33, 48, 100):
        for num_tokens in range(1, 160, 3):
            consumer = window_load(producer_bs, consumer_bs, window, num_tokens)
            stats = consumer.stats
            outcomes["verified" if stats.verified else str(dict(stats.unverified))] += 1
    assert outcomes == {"verified": 5 * len(range(1, 160, 3))}


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_PAIRS)
@pytest.mark.parametrize("from_end", [1, 16, 40])
def test_a_corrupted_token_in_the_window_fails_between_block_sizes(
    producer_bs: int, consumer_bs: int, from_end: int
) -> None:
    # Window 48: the last 48 tokens (and the one before, which a recomputed
    # last token reads) are compared.
    consumer = window_load(producer_bs, consumer_bs, 48, 150, bad_token=150 - from_end)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]
    assert consumer.stats.mismatch == 1


def test_a_sliding_window_payload_has_one_value_per_16_tokens() -> None:
    config = kv_config(full(64), SlidingWindowSpec(64, sliding_window=100))
    tokens = {g: token_values(RNG, 300) for g in range(2)}
    spec = config.kv_cache_groups[1].kv_cache_spec
    assert isinstance(spec, SlidingWindowSpec)
    producer = Producer(config, FakeWorkers(fingerprints={0: 1, 1: 2}))
    encoded = producer.send(
        300, FakeBlocks.of(list(range(1, 6)), window_blocks(spec, 300, 10)), tokens
    )
    payload = KVChecksumPayload.from_bytes(base64.b64decode(encoded))
    # Blocks 2..4 of 64 tokens kept: spans of 16 tokens 8..19.
    _, span, start, values = payload.groups[1]
    assert (span, start) == (16, 8)
    np.testing.assert_array_equal(values, block_sums(tokens[1], 16, 8, 12, 300))
    # Full attention: a value per block.
    assert payload.groups[0][1:3] == (64, 0)
    assert len(payload.groups[0][3]) == 5


def mamba_load(
    spec: MambaSpec, producer_tp: int, consumer_tp: int, state: int, loaded: int
) -> Consumer:
    config = kv_config(full(), spec)
    payload = KVChecksumPayload(
        producer_tp,
        40,
        {
            0: (1, 16, 0, np.array([5, 6, 7], dtype=np.uint64)),
            1: (2, spec.block_size, 0, np.array([state], dtype=np.uint64)),
        },
    )
    consumer = Consumer(config, FakeWorkers(tp=consumer_tp, fingerprints={0: 1, 1: 2}))
    req = consumer_request("c", 40, {KV_TRANSFER_PARAMS_KEY: payload.to_base64()})
    consumer.start_load(req, FakeBlocks.of([4, 5, 6], [None, 9]))
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert scheduled.reqs_to_recv["c"].groups[1] == (0, [9])
    values = {
        0: (0, np.array([5, 6, 7], dtype=np.uint64)),
        1: (0, np.array([loaded], dtype=np.uint64)),
    }
    consumer.failed = consumer.scheduler.update_from_output(  # type: ignore[attr-defined]
        FakeConnectorOutput(consumer.workers.report("c", values), {"c"}), set()
    )
    return consumer


def test_mamba_state_compares_as_one_block_whatever_the_block_size() -> None:
    consumer = mamba_load(MambaSpec(block_size=4096), 1, 1, state=77, loaded=77)
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.stats.verified == 1
    consumer = mamba_load(MambaSpec(block_size=4096), 1, 1, state=77, loaded=78)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]
    assert consumer.stats.mismatch == 1


def test_mamba_state_without_tp_splits_is_unverified_across_tp_sizes() -> None:
    consumer = mamba_load(MambaSpec(block_size=64), 2, 1, state=77, loaded=77)
    assert consumer.failed == {"c"}  # type: ignore[attr-defined]
    assert consumer.stats.unverified == {R.MAMBA_TP: 1}


@pytest.mark.parametrize(
    "spec",
    [MambaSpec(block_size=64, state_splits=(1,)), MambaSpec(64, tp_replicated=True)],
)
def test_mamba_state_with_tp_splits_or_replicated_verifies_across_tp_sizes(
    spec: MambaSpec,
) -> None:
    consumer = mamba_load(spec, 2, 1, state=77, loaded=77)
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.stats.verified == 1


# --- Unverified loads -----------------------------------------------------------


def load_with_payload(
    params: dict[str, object] | None,
    *,
    fail_closed: bool = True,
    consumer_config: KVCacheConfig | None = None,
    consumer_workers: FakeWorkers | None = None,
    consumer_blocks: FakeBlocks | None = None,
    num_tokens: int = 40,
    num_local_tokens: int = 0,
    ranks: list[tuple[int, int]] | None = None,
) -> Consumer:
    consumer = Consumer(
        consumer_config or kv_config(full()),
        consumer_workers or FakeWorkers(),
        fail_closed=fail_closed,
    )
    req = consumer_request("c", num_tokens, params)
    consumer.failed = consumer.load(  # type: ignore[attr-defined]
        req,
        consumer_blocks or FakeBlocks.of([1, 2, 3]),
        {0: token_values(RNG, num_tokens), 1: token_values(RNG, num_tokens)},
        num_local_tokens=num_local_tokens,
        ranks=ranks,
    )
    return consumer


def payload_params(
    *groups: tuple[int, int, int, int, list[int]],
    num_tokens: int = 40,
    tp_size: int = 1,
) -> dict[str, object]:
    payload = KVChecksumPayload(
        tp_size,
        num_tokens,
        {
            g: (fp, bs, start, np.array(values, dtype=np.uint64))
            for g, fp, bs, start, values in groups
        },
    )
    return {KV_TRANSFER_PARAMS_KEY: payload.to_base64()}


def wrong_version() -> str:
    import msgspec

    data = msgspec.msgpack.encode((2, 1, 40, [(0, 0xF00D, 16, 0, b"\0" * 24)]))
    return base64.b64encode(data).decode()


UNVERIFIED_CASES = {
    "no payload": (dict(params=None), R.NO_CHECKSUMS),
    "not base64": (dict(params={KV_TRANSFER_PARAMS_KEY: "%%%"}), R.INVALID_CHECKSUMS),
    "not text": (dict(params={KV_TRANSFER_PARAMS_KEY: 123}), R.INVALID_CHECKSUMS),
    "garbage bytes": (
        dict(params={KV_TRANSFER_PARAMS_KEY: base64.b64encode(b"\x93abc").decode()}),
        R.INVALID_CHECKSUMS,
    ),
    "wrong version": (
        dict(params={KV_TRANSFER_PARAMS_KEY: wrong_version()}),
        R.INVALID_CHECKSUMS,
    ),
    "a worker did not report": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1, 2, 3])),
            consumer_workers=FakeWorkers(tp=2),
            ranks=[(0, 0)],
        ),
        R.INCOMPLETE,
    ),
    "group sent but skipped by the consumer": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1, 2, 3])),
            consumer_workers=FakeWorkers(skipped=frozenset({0})),
        ),
        R.ONE_SIDE,
    ),
    "group checksummed by the consumer but not sent": (
        dict(params=payload_params()),
        R.ONE_SIDE,
    ),
    "other layers on the producer": (
        dict(params=payload_params((0, 0xBAD, 16, 0, [1, 2, 3]))),
        R.OTHER_LAYERS,
    ),
    "block sizes not multiples": (
        dict(params=payload_params((0, 0xF00D, 24, 0, [1, 2]))),
        R.BLOCK_SIZES,
    ),
    "first loaded block inside a producer block": (
        dict(
            params=payload_params((0, 0xF00D, 32, 0, [1]), num_tokens=32),
            consumer_blocks=FakeBlocks.of([1, 2]),
            num_tokens=32,
            num_local_tokens=16,
        ),
        R.START_INSIDE,
    ),
    "no block in common": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1]), num_tokens=16),
            consumer_blocks=FakeBlocks.of([1, 2, 3]),
            num_local_tokens=32,
        ),
        R.NO_COMMON_BLOCK,
    ),
    "only a last block, holding other tokens on the producer": (
        dict(
            params=payload_params((0, 0xF00D, 16, 0, [1, 2, 3]), num_tokens=41),
            num_local_tokens=32,
        ),
        R.NO_COMMON_BLOCK,
    ),
    "the loaded group skipped on both sides": (
        dict(
            params=payload_params(),
            consumer_workers=FakeWorkers(skipped=frozenset({0})),
        ),
        R.SKIPPED,
    ),
    "no loaded group checksummed on either side (drafter layers only)": (
        dict(
            params=payload_params(),
            consumer_workers=FakeWorkers(fingerprints={}, unheld=frozenset({0})),
        ),
        R.NOTHING_CHECKSUMMED,
    ),
}


@pytest.mark.parametrize("fail_closed", [True, False], ids=["closed", "open"])
@pytest.mark.parametrize("case", list(UNVERIFIED_CASES))
def test_an_unverified_load_fails_only_when_fail_closed(
    case: str, fail_closed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs, reason = UNVERIFIED_CASES[case]
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        consumer = load_with_payload(fail_closed=fail_closed, **kwargs)  # type: ignore[arg-type]
    assert consumer.failed == ({"c"} if fail_closed else set())  # type: ignore[attr-defined]
    assert consumer.stats.unverified == {reason: 1}
    assert consumer.stats.verified == consumer.stats.mismatch == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.message for r in warnings] == [f"KV checksums not verified: {reason}."]
    assert any(
        r.levelno == logging.DEBUG and "request c not verified" in r.message
        for r in caplog.records
    )


def test_a_group_skipped_on_both_sides_does_not_hide_a_mismatch_of_another() -> None:
    config = kv_config(full(), full())
    consumer = load_with_payload(
        payload_params((0, 0xF00D, 16, 0, [0, 0, 0])),
        consumer_config=config,
        consumer_workers=FakeWorkers(
            fingerprints={0: 0xF00D, 1: 1}, skipped=frozenset({1})
        ),
        consumer_blocks=FakeBlocks.of([1, 2, 3], [4, 5, 6]),
    )
    # Group 0 is compared (and mismatches: other random KV), group 1 is not
    # (unverified, but a mismatch is what the load fails for).
    assert consumer.stats.mismatch == 1
    assert not consumer.stats.unverified


def test_a_stale_worker_report_leaves_the_load_unverified() -> None:
    consumer = Consumer(kv_config(full()))
    req = consumer_request("c", 40, payload_params((0, 0xF00D, 16, 0, [1, 2, 3])))
    consumer.start_load(req, FakeBlocks.of([1, 2, 3]))
    consumer.scheduler.build_checksum_meta()
    records = consumer.workers.report("c", {0: (1, np.zeros(3, dtype=np.uint64))})
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"c"}), set()
    )
    assert failed == {"c"}
    assert consumer.stats.unverified == {R.OTHER_BLOCKS: 1}


def test_an_unverified_reason_is_warned_once_and_detailed_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    consumer = Consumer(kv_config(full()))
    with caplog.at_level(logging.DEBUG, logger="kvguard.engine_patch.scheduler"):
        for i in range(3):
            req = consumer_request(f"c{i}", 16)
            consumer.load(req, FakeBlocks.of([1]), {0: token_values(RNG, 16)})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    debug = [r.message for r in caplog.records if r.levelno == logging.DEBUG]
    for i in range(3):
        assert any(f"request c{i} not verified" in m for m in debug)
    assert consumer.stats.unverified == {R.NO_CHECKSUMS: 3}


def test_stats_count_every_outcome() -> None:
    config = kv_config(full())
    tokens = {0: token_values(RNG, 32)}
    producer = Producer(config)
    consumer = Consumer(config, fail_closed=False)
    for i, loaded in enumerate([tokens, tokens, {0: corrupt(tokens[0], 3)}, None]):
        req = producer_request(f"r{i}", 32)
        producer.prefill(req, FakeBlocks.of([1, 2]), tokens)
        encoded = producer.finish(req)
        params = {KV_TRANSFER_PARAMS_KEY: encoded} if loaded is not None else {}
        consumer.load(
            consumer_request(f"r{i}", 32, params),
            FakeBlocks.of([3, 4]),
            loaded or tokens,
        )
    assert producer.scheduler.stats.sent == 4
    assert consumer.stats.verified == 2
    assert consumer.stats.mismatch == 1
    assert consumer.stats.unverified == {R.NO_CHECKSUMS: 1}


# --- Offloaded KV ---------------------------------------------------------------


OFFLOAD = CacheHitSource.OFFLOAD


def hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [salt + i.to_bytes(4, "little") for i in range(n)]


def stored_values(
    values: np.ndarray, block_hashes: list[bytes], fingerprint: int = 0xF00D
) -> np.ndarray:
    return values ^ block_checksum_tags(block_hashes, fingerprint)


def offload_reload(
    stored: np.ndarray,
    loaded: np.ndarray,
    *,
    block_hashes: list[bytes],
    fail_closed: bool = True,
    hash_block_size: int | None = None,
    num_local_tokens: int = 0,
) -> Consumer:
    """An offloaded load of blocks 0..n of a request (after its
    ``num_local_tokens`` cached ones); workers report ``loaded`` and the
    stored values."""
    connector = FakeConnector(
        sources={OFFLOAD: 1}, checksum_sources=frozenset({OFFLOAD})
    )
    consumer = Consumer(
        kv_config(full(), hash_block_size=hash_block_size),
        fail_closed=fail_closed,
        connector=connector,
    )
    first = num_local_tokens // 16
    num_blocks = first + len(loaded)
    req = FakeRequest("o", num_prompt_tokens=num_blocks * 16, block_hashes=block_hashes)
    consumer.start_load(
        req, FakeBlocks.of(list(range(1, num_blocks + 1))), num_local_tokens
    )
    scheduled = consumer.scheduler.build_checksum_meta()
    assert scheduled is not None
    assert not scheduled.reqs_to_recv
    assert scheduled.reqs_to_load["o"].groups == {
        0: (first, list(range(first + 1, num_blocks + 1)))
    }
    # One worker: its share is the whole checksum.
    records = consumer.workers.report("o", {0: (first, loaded)}, stored={0: stored})
    consumer.failed = consumer.scheduler.update_from_output(  # type: ignore[attr-defined]
        FakeConnectorOutput(records, {"o"}), set()
    )
    return consumer


def test_an_offloaded_load_verifies_against_the_stored_checksums() -> None:
    values = token_values(RNG, 3)
    block_hashes = hashes(3)
    consumer = offload_reload(
        stored_values(values, block_hashes), values, block_hashes=block_hashes
    )
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.stats.verified == 1
    assert consumer.connector.failures == []


def test_an_offloaded_block_with_flipped_bits_fails_and_the_connector_hears() -> None:
    values = token_values(RNG, 3)
    block_hashes = hashes(3)
    loaded = values.copy()
    loaded[1] ^= np.uint64(1 << 17)
    consumer = offload_reload(
        stored_values(values, block_hashes), loaded, block_hashes=block_hashes
    )
    assert consumer.failed == {"o"}  # type: ignore[attr-defined]
    assert consumer.connector.failures == [("o", {0: [1]})]
    assert consumer.stats.mismatch == 1


def test_an_offloaded_block_reloaded_at_the_wrong_position_fails() -> None:
    values = token_values(RNG, 3)
    block_hashes = hashes(3)
    # Blocks 1 and 2 come back swapped: the data is intact but the tag of
    # the position each now holds differs.
    stored = stored_values(values, block_hashes)
    loaded = values[[0, 2, 1]]
    consumer = offload_reload(stored[[0, 2, 1]], loaded, block_hashes=block_hashes)
    assert consumer.failed == {"o"}  # type: ignore[attr-defined]
    assert consumer.connector.failures == [("o", {0: [1, 2]})]


def test_an_offloaded_block_of_another_request_fails() -> None:
    values = token_values(RNG, 2)
    theirs = hashes(2, salt=b"other")
    consumer = offload_reload(
        stored_values(values, theirs), values, block_hashes=hashes(2)
    )
    assert consumer.connector.failures == [("o", {0: [0, 1]})]


def test_offloaded_load_after_a_prefix_hit_uses_the_hashes_of_its_positions() -> None:
    values = token_values(RNG, 2)
    block_hashes = hashes(4)
    consumer = offload_reload(
        stored_values(values, block_hashes[2:]),
        values,
        block_hashes=block_hashes,
        num_local_tokens=32,
    )
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.stats.verified == 1


def test_offloaded_load_with_finer_block_hashes_uses_each_blocks_last_hash() -> None:
    values = token_values(RNG, 2)
    # Hashes per 8 tokens: block b's identity is hash 2b + 1.
    block_hashes = hashes(4)
    consumer = offload_reload(
        stored_values(values, block_hashes[1::2]),
        values,
        block_hashes=block_hashes,
        hash_block_size=8,
    )
    assert consumer.failed == set()  # type: ignore[attr-defined]


def test_fail_open_still_tells_the_connector_of_corrupted_offloaded_kv() -> None:
    values = token_values(RNG, 2)
    block_hashes = hashes(2)
    loaded = values ^ np.uint64(1)
    consumer = offload_reload(
        stored_values(values, block_hashes),
        loaded,
        block_hashes=block_hashes,
        fail_closed=False,
    )
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.connector.failures == [("o", {0: [0, 1]})]


def test_an_offloaded_load_without_block_hashes_is_unverified() -> None:
    values = token_values(RNG, 3)
    consumer = offload_reload(
        values,
        values,
        block_hashes=hashes(2),  # Block 2 has no hash.
    )
    assert consumer.failed == {"o"}  # type: ignore[attr-defined]
    assert consumer.stats.unverified == {R.NO_BLOCK_HASH: 1}
    # The load fails, so the connector hears of it, with no positions.
    assert consumer.connector.failures == [("o", {})]


def test_an_unverified_offloaded_load_under_fail_open_is_not_a_failure() -> None:
    values = token_values(RNG, 3)
    consumer = offload_reload(values, values, block_hashes=hashes(2), fail_closed=False)
    assert consumer.failed == set()  # type: ignore[attr-defined]
    assert consumer.connector.failures == []
    assert consumer.stats.unverified == {R.NO_BLOCK_HASH: 1}


def test_a_worker_without_stored_checksums_leaves_the_offloaded_load_unverified() -> (
    None
):
    connector = FakeConnector(
        sources={OFFLOAD: 1}, checksum_sources=frozenset({OFFLOAD})
    )
    consumer = Consumer(kv_config(full()), connector=connector)
    req = FakeRequest("o", num_prompt_tokens=16, block_hashes=hashes(1))
    consumer.start_load(req, FakeBlocks.of([1]))
    consumer.scheduler.build_checksum_meta()
    records = consumer.workers.report("o", {0: (0, np.zeros(1, dtype=np.uint64))})
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"o"}), set()
    )
    assert failed == {"o"}
    assert consumer.stats.unverified == {R.NO_STORED: 1}


def test_an_offloaded_load_of_no_checksummed_group_is_not_checked() -> None:
    connector = FakeConnector(
        sources={OFFLOAD: 1}, checksum_sources=frozenset({OFFLOAD})
    )
    consumer = Consumer(
        kv_config(full()), FakeWorkers(skipped=frozenset({0})), connector=connector
    )
    req = FakeRequest("o", num_prompt_tokens=16, block_hashes=hashes(1))
    consumer.start_load(req, FakeBlocks.of([1]))
    consumer.scheduler.build_checksum_meta()
    records = consumer.workers.report("o", {0: (0, np.zeros(1, dtype=np.uint64))})
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput(records, {"o"}), set()
    )
    assert failed == set()
    assert connector.failures == []
    assert consumer.stats.verified == 0
    assert not consumer.stats.unverified


def test_a_load_from_sources_without_stored_checksums_is_not_checksummed() -> None:
    connector = FakeConnector(
        sources={OFFLOAD: 8, CacheHitSource.P2P: 8},
        checksum_sources=frozenset({OFFLOAD}),
    )
    consumer = Consumer(kv_config(full()), connector=connector)
    consumer.start_load(FakeRequest("o", num_prompt_tokens=16), FakeBlocks.of([1]))
    assert consumer.scheduler.build_checksum_meta() is None


# --- Chunk sums -----------------------------------------------------------------


def test_chunk_sums_of_small_blocks_equal_the_large_blocks() -> None:
    tokens = token_values(RNG, 70)
    small = block_sums(tokens, 16, 0, 5, 70)
    first, sums = chunk_sums(small, 0, 16, 32, 70)
    assert first == 0
    np.testing.assert_array_equal(sums, block_sums(tokens, 32, 0, 3, 70))


def test_chunk_sums_leave_out_chunks_not_covered_whole() -> None:
    values = np.arange(1, 6, dtype=np.uint64)
    # Blocks 1..5 of 16 tokens of a 200-token request, chunks of 32: block 1
    # is half of chunk 0 and block 5 half of chunk 2; chunks 1..2 are whole.
    first, sums = chunk_sums(values, 1, 16, 32, 200)
    assert first == 1
    assert sums.tolist() == [2 + 3, 4 + 5]


def test_chunk_sums_with_a_huge_block_size_do_not_allocate_it() -> None:
    first, sums = chunk_sums(np.ones(3, dtype=np.uint64), 0, 16, 16 << 40, 40)
    assert (first, sums.tolist()) == (0, [3])


def _reference_chunk_sums(
    values: np.ndarray, start: int, block_size: int, chunk_size: int, num_tokens: int
) -> tuple[int, np.ndarray]:
    """A plain reference of chunk sums: it pads the last chunk with zero blocks."""
    blocks_per_chunk = chunk_size // block_size
    end = start + len(values)
    if end >= -(-num_tokens // block_size):
        values = np.pad(values, (0, -end % blocks_per_chunk))
        end += -end % blocks_per_chunk
    first = -(-start // blocks_per_chunk)
    last = max(first, end // blocks_per_chunk)
    whole = values[first * blocks_per_chunk - start : last * blocks_per_chunk - start]
    return first, whole.reshape(-1, blocks_per_chunk).sum(axis=1, dtype=np.uint64)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=12),
    st.integers(0, 10),
    st.sampled_from([1, 2, 16]),
    st.integers(1, 4),
    st.integers(0, 400),
)
def test_chunk_sums_equal_the_specs_padded_sums(
    values: list[int],
    start: int,
    block_size: int,
    blocks_per_chunk: int,
    num_tokens: int,
) -> None:
    array = np.array(values, dtype=np.uint64)
    chunk_size = block_size * blocks_per_chunk
    first, sums = chunk_sums(array, start, block_size, chunk_size, num_tokens)
    want_first, want = _reference_chunk_sums(
        array, start, block_size, chunk_size, num_tokens
    )
    if len(want):
        assert first == want_first
    assert sums.tolist() == want.tolist()


# --- Cost -------------------------------------------------------------------


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
