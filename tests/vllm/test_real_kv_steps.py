"""KVGuard's worker side in vLLM 0.32's worker hook, over real KV tensors
(``real_kv_steps``): the producer's checksums of the prompt KV it wrote
verify the consumer's load of a clean copy and fail a corrupted one, and
the workers' stats count what they checksummed and held.

Each request is 100 tokens: 4 blocks of 32, the last one part full.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from engine_steps import (
    LAYERS,
    finished,
    kv_cache_config,
    kvguard_counts,
    producer_request,
    request,
    vllm_config,
)
from real_kv_steps import Engine, copy_blocks, prefill
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from engine_patch.vllm.host import UnsupportedKVCacheError, kv_layers
from engine_patch.vllm.metadata import KVGuardWorkerMetadata
from engine_patch.vllm.scheduler import KVGuardScheduler
from engine_patch.vllm.stats import KVGuardConnectorStats

pytestmark = pytest.mark.vllm

NUM_TOKENS = 100
NUM_BLOCKS = 4
# 2 layers x 2 KV heads x 32 tokens x (32 K + 32 V) bfloat16.
BLOCK_BYTES = 2 * 2 * 32 * 64 * 2

MODES = pytest.mark.parametrize(
    "cls", [Scheduler, KVGuardScheduler], ids=["connector-only", "scheduler-class"]
)


def start_decode(consumer: Engine, params: dict[str, Any], req_id: str = "d1") -> None:
    """The proxy's decode request with the prefill's params; the step that
    starts its load."""
    consumer.scheduler.add_request(
        request(req_id, NUM_TOKENS, dict(params), max_tokens=2)
    )
    assert not consumer.step()
    status = consumer.scheduler.requests[req_id].status
    assert status == RequestStatus.WAITING_FOR_REMOTE_KVS


def load_finishes(consumer: Engine, req_id: str = "d1") -> dict[str, Any]:
    """The step whose inner connector reports the load finished and three
    more (enough to decode 2 tokens, in either mode); KVGuard's counts of
    those steps and how the request ended (None: still running)."""
    counts: dict[str, Any] = {}
    ended: dict[str, Any] = {}
    results = KVConnectorTransferResults(finished_recving={req_id})
    for _ in range(4):
        consumer.step(results)
        results = KVConnectorTransferResults()
        for key, value in kvguard_counts(consumer.outputs).items():
            if isinstance(value, int):
                counts[key] = counts.get(key, 0) + value
        ended |= finished(consumer.outputs)
    return {"counts": counts, "ended": ended.get(req_id)}


def transfer(
    producer: Engine, params: dict[str, Any], consumer: Engine, req_id: str = "d1"
) -> None:
    copy_blocks(
        producer, params["remote_block_ids"][0], consumer, consumer.block_ids(req_id)
    )


def decode_once(producer: Engine, consumer: Engine, req_id: str) -> dict[str, Any]:
    """One P/D request through the pair, its KV copied clean: what
    :func:`load_finishes` says of its load."""
    params = prefill(producer, f"p-{req_id}", NUM_TOKENS)
    start_decode(consumer, params, req_id)
    transfer(producer, params, consumer, req_id)
    return load_finishes(consumer, req_id)


def worker_counts(engine: Engine) -> dict[str, Any]:
    """KVGuard's worker counts summed over the engine's steps so far."""
    totals: dict[str, Any] = {}
    for output in engine.worker_outputs:
        stats = output.kv_connector_stats
        if stats is None:
            continue
        assert isinstance(stats, KVGuardConnectorStats)
        for key, value in stats.counts.items():
            if isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0) + value
    return totals


@MODES
def test_a_clean_copy_of_the_producers_kv_verifies_and_decodes(
    cls: type[Scheduler],
) -> None:
    producer, consumer = Engine("kv_producer"), Engine("kv_consumer", cls)
    outcome = decode_once(producer, consumer, "d1")
    assert outcome["counts"]["verified"] == 1
    assert outcome["counts"]["mismatch"] == 0
    assert outcome["ended"] == FinishReason.LENGTH


@MODES
@pytest.mark.parametrize("block", range(NUM_BLOCKS))
def test_one_bit_flipped_in_transfer_fails_the_load(
    cls: type[Scheduler], block: int
) -> None:
    producer, consumer = Engine("kv_producer"), Engine("kv_consumer", cls)
    params = prefill(producer, "p1", NUM_TOKENS)
    start_decode(consumer, params)
    transfer(producer, params, consumer)
    # A bit of the second layer's V, in a token the decode uses.
    kv = consumer.kv[list(consumer.kv)[1]].view(torch.int16)
    kv[consumer.block_ids("d1")[block], 1, 2, 40] ^= 1 << 3
    outcome = load_finishes(consumer)
    assert outcome["counts"]["mismatch"] == 1
    assert outcome["counts"].get("verified", 0) == 0
    assert outcome["ended"] == FinishReason.ERROR


def test_kv_past_the_prompt_in_its_last_block_is_not_compared() -> None:
    producer, consumer = Engine("kv_producer"), Engine("kv_consumer")
    params = prefill(producer, "p1", NUM_TOKENS)
    start_decode(consumer, params)
    transfer(producer, params, consumer)
    # Slots 4-31 of the last block: tokens 100-127, past the prompt.
    last = consumer.block_ids("d1")[-1]
    for kv in consumer.kv.values():
        kv[last, :, NUM_TOKENS % 32 :] = 7.0
    assert load_finishes(consumer)["counts"]["verified"] == 1


@MODES
def test_workers_count_what_they_checksum_and_hold_and_for_how_long(
    cls: type[Scheduler],
) -> None:
    start = time.perf_counter()
    producer, consumer = Engine("kv_producer"), Engine("kv_consumer", cls)
    decode_once(producer, consumer, "d1")
    elapsed = time.perf_counter() - start
    for engine in (producer, consumer):
        counts = worker_counts(engine)
        # Every block once: the producer's send, the consumer's load.
        assert counts["checksum_bytes"] == NUM_BLOCKS * BLOCK_BYTES
        assert 0 < counts["checksum_seconds"] < elapsed
    held = worker_counts(consumer)
    if cls is KVGuardScheduler:  # same-step verdicts: nothing waits
        assert (held["held_loads"], held["hold_seconds"]) == (0, 0)
    else:
        assert held["held_loads"] == 1
        assert 0 < held["hold_seconds"] < elapsed


def test_the_inner_connectors_stats_ride_with_kvguards() -> None:
    producer, consumer = Engine("kv_producer"), Engine("kv_consumer")
    params = prefill(producer, "p1", NUM_TOKENS)
    start_decode(consumer, params)
    transfer(producer, params, consumer)
    consumer.step(KVConnectorTransferResults(finished_recving={"d1"}))
    stats = consumer.worker_outputs[-1].kv_connector_stats
    assert isinstance(stats, KVGuardConnectorStats)
    assert stats.counts["checksum_bytes"] == NUM_BLOCKS * BLOCK_BYTES
    assert stats.data["inner"]["connector"] == "LoopbackConnector"
    assert stats.inner is not None and stats.inner.data == {"transfers": 1}
    # Steps with nothing checksummed: the inner connector's stats alone,
    # and none at all where it has none either.
    producer.step()  # the send's checksum time, taken after its stats
    producer.step(KVConnectorTransferResults(finished_sending={"p1"}))
    stats = producer.worker_outputs[-1].kv_connector_stats
    assert isinstance(stats, KVGuardConnectorStats)
    assert stats.inner is not None and stats.inner.data == {"transfers": 1}
    assert stats.counts["checksum_bytes"] == 0
    assert stats.counts["checksum_seconds"] == 0
    producer.step()
    assert producer.worker_outputs[-1].kv_connector_stats is None


def test_a_step_with_nothing_of_kvguards_sends_no_worker_report() -> None:
    producer = Engine("kv_producer")
    prefill(producer, "p1", NUM_TOKENS)
    meta = producer.worker_outputs[-1].kv_connector_worker_meta
    assert isinstance(meta, KVGuardWorkerMetadata)
    (report,) = meta.reports
    assert report.record is not None and set(report.record.checksums) == {"p1"}
    producer.step()
    assert producer.worker_outputs[-1].kv_connector_worker_meta is None


def test_a_send_is_held_by_the_worker_until_its_prompt_is_checksummed() -> None:
    producer = Engine("kv_producer")
    worker = producer.connector._worker
    assert worker is not None
    held_in_forward: list[set[str]] = []
    producer.scheduler.add_request(producer_request("p1", NUM_TOKENS))
    producer.step(forward=lambda: held_in_forward.append(worker.held_request_ids()))
    assert held_in_forward == [{"p1"}]
    assert worker.held_request_ids() == set()


def test_the_legacy_get_finished_reports_what_get_transfer_results_does() -> None:
    producer = Engine("kv_producer")
    prefill(producer, "p1", NUM_TOKENS)
    producer.inner.report(KVConnectorTransferResults(finished_sending={"p1"}))
    assert producer.connector.get_finished(set()) == ({"p1"}, None)
    assert producer.connector.get_finished(set()) == (None, None)


def test_with_checksums_off_the_worker_registers_nothing_and_loads_go_through() -> None:
    producer = Engine("kv_producer", checksums=False)
    consumer = Engine("kv_consumer", checksums=False)
    assert consumer.connector._worker is not None
    assert consumer.connector._worker.layers == []
    assert consumer.inner.registered.keys() == consumer.kv.keys()
    params = prefill(producer, "p1", NUM_TOKENS)
    assert "kv_checksums" not in params
    start_decode(consumer, params)
    outcome = load_finishes(consumer)  # no copy: the KV is whatever it is
    assert outcome["ended"] == FinishReason.LENGTH
    assert worker_counts(consumer).get("checksum_bytes", 0) == 0


def test_a_fault_injecting_consumer_corrupts_the_loads_it_chooses() -> None:
    producer = Engine("kv_producer")
    consumer = Engine("kv_consumer", faults={"loads": "every_other"})
    outcomes = [decode_once(producer, consumer, f"d{i}") for i in range(3)]
    assert [o["ended"] for o in outcomes] == [
        FinishReason.ERROR,
        FinishReason.LENGTH,
        FinishReason.ERROR,
    ]
    assert [o["counts"]["mismatch"] for o in outcomes] == [1, 0, 1]


@pytest.mark.parametrize(
    ("layers", "caught"), [("full_attention", True), ("sliding_window", False)]
)
def test_fault_injection_corrupts_only_the_kind_of_layer_it_names(
    layers: str, caught: bool
) -> None:
    # The tiny llama has full-attention layers only.
    producer = Engine("kv_producer")
    consumer = Engine("kv_consumer", faults={"loads": "all", "layers": layers})
    outcome = decode_once(producer, consumer, "d1")
    assert outcome["counts"]["mismatch"] == int(caught)
    assert outcome["counts"].get("verified", 0) == int(not caught)


def _register(kv_caches: dict[str, torch.Tensor]) -> list[Any]:
    config = vllm_config("kv_consumer")
    return kv_layers(
        config, kv_cache_config(config), kv_caches, covered_groups={0}, tp_rank=0
    )


def test_registered_kv_of_vllms_layout_is_checksummed_per_layer() -> None:
    kv = {name: torch.zeros(8, 2, 32, 64, dtype=torch.bfloat16) for name in LAYERS}
    layers = _register(kv)
    assert [(layer.name, layer.index) for layer in layers] == [
        (LAYERS[0], 0),
        (LAYERS[1], 1),
    ]
    assert all(layer.kv is kv[layer.name] for layer in layers)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((8, 2, 16, 64), r"\[8, 2, 16, 64\] is not \[blocks, 2 heads, 32 tokens"),
        ((8, 1, 32, 64), r"is not \[blocks, 2 heads, 32 tokens"),
        ((8, 2, 32), r"is not \[blocks, 2 heads, 32 tokens"),
        ((8, 2, 32, 2, 32), r"is not \[blocks, 2 heads, 32 tokens"),
    ],
)
def test_registered_kv_of_another_shape_is_refused(
    shape: tuple[int, ...], message: str
) -> None:
    kv = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in LAYERS}
    with pytest.raises(UnsupportedKVCacheError, match=message):
        _register(kv)


def test_a_covered_layer_that_registered_no_kv_is_refused() -> None:
    kv = {LAYERS[0]: torch.zeros(8, 2, 32, 64, dtype=torch.bfloat16)}
    with pytest.raises(UnsupportedKVCacheError, match="registered no KV cache"):
        _register(kv)
