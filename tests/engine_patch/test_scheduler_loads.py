"""KVChecksumScheduler (hand-built worker records, no torch): a consumer's
load verified, or failed with its mismatching block positions, across block
sizes and partial loads."""

from __future__ import annotations

import logging

import pytest
from kv_host_fakes import (
    FakeBlocks,
    FakeConnector,
    FakeConnectorOutput,
    FakeRequest,
    FakeWorkers,
    consumer_request,
    producer_request,
    scheduled_values,
    token_values,
)
from scheduler_harness import (
    RNG,
    Consumer,
    Producer,
    R,
    corrupt,
    full,
    kv_config,
    load_with_payload,
    window_blocks,
)

from engine_patch.host import CacheHitSource
from engine_patch.kv_cache import (
    KVCacheConfig,
    SlidingWindowSpec,
)
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY
from engine_patch.verify import (
    UnverifiedReason,
)


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
    consumer.failed = consumer.load(
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
    assert consumer.failed == ({"c"} if fail_closed else set())
    assert consumer.stats.verified == consumer.stats.mismatch == 0
    assert consumer.stats.unverified == {R.UNCOVERED: 1}
    assert "group 0: tokens [32, 70) of the loaded [0, 70)" in caplog.text
    if fail_closed:
        [message] = consumer.scheduler.take_load_failures().values()
        assert f"{R.UNCOVERED} (group 0: tokens [32, 70)" in message


def test_a_last_block_holding_other_tokens_than_the_producers_is_unverified() -> None:
    # The producer's block 2 holds tokens 32..40, the consumer's 32..39.
    consumer = load_of_other_length(41, 40)
    assert consumer.failed == {"c"}
    assert consumer.stats.unverified == {R.UNCOVERED: 1}


def test_a_load_of_fewer_tokens_within_the_payloads_blocks_verifies() -> None:
    # Whole blocks on both sides: every loaded token is compared.
    consumer = load_of_other_length(70, 48)
    assert consumer.failed == set()
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


@pytest.mark.parametrize("fail_closed", [True, False])
def test_a_consumer_load_not_wholly_from_its_producer_is_unverified(
    fail_closed: bool,
) -> None:
    connector = FakeConnector(
        sources={CacheHitSource.P2P: 8, CacheHitSource.OFFLOAD: 8}
    )
    consumer = Consumer(kv_config(full()), connector=connector, fail_closed=fail_closed)
    consumer.start_load(consumer_request("c", 16), FakeBlocks.of([1]))
    # Nothing to checksum: which tokens came from the producer is unknown.
    assert consumer.scheduler.build_checksum_meta() is None
    failed = consumer.scheduler.update_from_output(
        FakeConnectorOutput([], {"c"}), set()
    )
    assert failed == ({"c"} if fail_closed else set())
    assert consumer.stats.unverified == {R.MIXED_SOURCES: 1}
    assert consumer.stats.verified == 0
