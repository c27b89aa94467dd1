"""Two engines end to end: a producer's scheduler and workers checksum its
prefill, a simulated transfer copies the KV into a consumer's blocks (other
ids, block size, TP/PP split and layout), and the consumer's scheduler and
workers verify the load; and offloaded KV reloaded against its stored
checksums."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Literal

import numpy as np
import pytest
import torch
from kv_host_fakes import FakeBlocks
from pd_models import (
    CLEAN_PAIRINGS,
    MODEL,
    PAIRINGS,
    SLIDING,
    WINDOW,
    engines,
)
from pd_sim import (
    KV,
    GroupShape,
    ModelShape,
    SimEngine,
    offload,
    offload_engine,
    reload,
    transfer,
)

from engine_patch.host import FinishReason
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY
from engine_patch.verify import UnverifiedReason
from engine_patch.worker import KVLayout

R = UnverifiedReason


# --- Correct loads ------------------------------------------------------------


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_a_correct_load_verifies(pairing: str) -> None:
    producer, consumer = engines(*PAIRINGS[pairing])
    t = transfer(producer, consumer, 50)
    assert KV_TRANSFER_PARAMS_KEY in t.params
    assert t.load() == set()
    assert consumer.scheduler.stats.verified == 1
    assert producer.scheduler.stats.sent == 1


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), [(16, 32), (32, 16)])
@pytest.mark.parametrize("num_tokens", [64, 70, 5])
def test_a_load_between_block_sizes_verifies(
    producer_bs: int, consumer_bs: int, num_tokens: int
) -> None:
    producer, consumer = engines(producer_bs=producer_bs, consumer_bs=consumer_bs)
    assert transfer(producer, consumer, num_tokens).load() == set()
    assert consumer.scheduler.stats.verified == 1


@pytest.mark.parametrize("layout", list(KVLayout))
def test_a_load_verifies_in_every_layout(layout: KVLayout) -> None:
    producer = SimEngine(MODEL, tp=2, layout=layout)
    consumer = SimEngine(MODEL, layout=layout, block_size=32)
    assert transfer(producer, consumer, 45).load() == set()


def _corrupt_tokens(tokens: Iterable[int]) -> Callable[[SimEngine, FakeBlocks], None]:
    """Flip a bit of every cell of these tokens in a consumer's caches,
    after the load."""

    def corrupt(engine: SimEngine, blocks: FakeBlocks) -> None:
        for caches in engine.caches.values():
            for cache in caches:
                u = cache.layer.kv.view(torch.uint8)
                for token in tokens:
                    table = blocks.blocks[cache.group_id]
                    block_id = table[token // engine.block_size].block_id
                    offset = token % engine.block_size
                    if cache.layer.layout is KVLayout.SPLIT:
                        u[0, block_id, offset] ^= 1
                    elif cache.layer.layout is KVLayout.PACKED_HND:
                        u[block_id, :, offset] ^= 1
                    else:
                        u[block_id, offset] ^= 1

    return corrupt


def test_a_consumer_prefix_hit_verifies_only_the_loaded_blocks() -> None:
    producer, consumer = engines(consumer=(2, 1))
    t = transfer(producer, consumer, 70)

    # The consumer's own cached blocks 0..1 differ from the producer's:
    # they are not loaded, so not compared.
    failed = t.load(num_local_tokens=32, corrupt_cache=_corrupt_tokens(range(0, 32)))
    assert failed == set()
    assert consumer.scheduler.stats.verified == 1


def test_a_corrupted_block_after_a_prefix_hit_fails() -> None:
    producer, consumer = engines()
    t = transfer(producer, consumer, 70)
    failed = t.load(num_local_tokens=32, corrupt_cache=_corrupt_tokens([40]))
    assert failed == {"req"}


# --- Corrupted loads ------------------------------------------------------------


def flip(
    g: int, layer: int, token: int, head: int, byte: int, bit: int
) -> Callable[[KV], None]:
    def corrupt(kv: KV) -> None:
        kv[g][layer, token, head, byte] ^= 1 << bit

    return corrupt


def test_a_corrupted_load_fails_under_fail_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer, consumer = engines(consumer=(2, 1))
    t = transfer(producer, consumer, 50)
    with caplog.at_level(logging.ERROR, logger="kvguard.engine_patch.scheduler"):
        assert t.load(corrupt=flip(0, 2, 20, 1, 9, 4)) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1
    assert "request req: group 0 block positions [1]" in caplog.text


def test_a_corrupted_load_is_logged_but_used_under_fail_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer, consumer = engines(consumer_bs=32, fail_closed=False)
    t = transfer(producer, consumer, 50)
    with caplog.at_level(logging.ERROR, logger="kvguard.engine_patch.scheduler"):
        assert t.load(corrupt=flip(0, 0, 40, 0, 0, 0)) == set()
    assert consumer.scheduler.stats.mismatch == 1
    assert "group 0 block positions [1]" in caplog.text
    assert "fail-open" in caplog.text


def test_a_corrupted_copy_of_replicated_heads_fails() -> None:
    # TP 4 over 2 KV heads: ranks 0 and 1 both hold head 0.
    producer, consumer = engines((1, 1), (4, 1))
    assert {c.layer.replicas for c in consumer.caches[0, 1]} == {2}
    assert {c.layer.replica_index for c in consumer.caches[0, 1]} == {1}
    t = transfer(producer, consumer, 40)

    def corrupt_second_copy(engine: SimEngine, blocks: FakeBlocks) -> None:
        cache = engine.caches[0, 1][0]
        block_id = blocks.blocks[0][1].block_id
        cache.layer.kv.view(torch.uint8)[block_id, 0, 3, 0] ^= 0x10

    assert t.load(corrupt_cache=corrupt_second_copy) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


# --- The prefix cache -------------------------------------------------------------


def prefix_caching_engines(fail_closed: bool) -> tuple[SimEngine, SimEngine]:
    producer, consumer = engines(fail_closed=fail_closed)
    consumer.prefix_caching = True
    return producer, consumer


def test_a_verified_loads_blocks_serve_a_later_request_from_the_prefix_cache() -> None:
    producer, consumer = prefix_caching_engines(fail_closed=True)
    assert transfer(producer, consumer, 70, seed=3, req_id="a").load() == set()
    again = transfer(producer, consumer, 70, seed=3, req_id="b")
    assert again.load() == set()
    # Blocks 0..3 came from the cache; only the last was loaded.
    assert again.num_cached_tokens == 64
    for g, kv in again.kv.items():
        np.testing.assert_array_equal(again.seen[g], kv)


@pytest.mark.parametrize("fail_closed", [True, False], ids=["closed", "open"])
def test_a_mismatched_loads_blocks_never_serve_another_request(
    fail_closed: bool,
) -> None:
    producer, consumer = prefix_caching_engines(fail_closed)
    first = transfer(producer, consumer, 70, seed=3, req_id="a")
    failed = first.load(corrupt=flip(0, 1, 20, 0, 2, 3))
    # Fail-open: the request itself goes on with what it loaded.
    assert failed == ({"a"} if fail_closed else set())
    assert consumer.scheduler.stats.mismatch == 1
    again = transfer(producer, consumer, 70, seed=3, req_id="b")
    assert again.load() == set()
    # It decodes from the producer's KV: nothing was cached from the bad
    # load, the same prompt loads it all.
    for g, kv in again.kv.items():
        np.testing.assert_array_equal(again.seen[g], kv)
    assert again.num_cached_tokens == 0
    assert consumer.scheduler.stats.verified == 1


# --- Unverified loads -----------------------------------------------------------


@pytest.mark.parametrize("fail_closed", [True, False])
def test_a_load_without_a_payload_is_unverified(fail_closed: bool) -> None:
    producer, consumer = engines(fail_closed=fail_closed)
    t = transfer(producer, consumer, 30)
    failed = t.load(params={"do_remote_prefill": True})
    assert failed == ({"req"} if fail_closed else set())
    assert consumer.scheduler.stats.unverified == {R.NO_CHECKSUMS: 1}


@pytest.mark.parametrize("garbage", ["not base64!", "AAAA", 42, ["x"]])
def test_a_load_with_a_garbage_payload_is_unverified(garbage: object) -> None:
    producer, consumer = engines()
    t = transfer(producer, consumer, 30)
    failed = t.load(params={"do_remote_prefill": True, KV_TRANSFER_PARAMS_KEY: garbage})
    assert failed == {"req"}
    assert consumer.scheduler.stats.unverified == {R.INVALID_CHECKSUMS: 1}


def test_a_load_missing_a_consumer_workers_report_is_unverified() -> None:
    producer, consumer = engines(consumer=(2, 1))
    t = transfer(producer, consumer, 30)
    assert t.load(ranks=[(0, 0)]) == {"req"}
    assert consumer.scheduler.stats.unverified == {R.INCOMPLETE: 1}


# Group 1's float16 cells of head size 3 are 12 bytes: not whole pieces, so
# its workers skip it; as float32 they are 24 bytes, checksummed.
TWO_GROUPS_SKIPPED = ModelShape(
    groups=(GroupShape(layers=(0, 1)), GroupShape(layers=(2, 3), head_size=3))
)
TWO_GROUPS_CHECKED = ModelShape(
    groups=(
        GroupShape(layers=(0, 1)),
        GroupShape(layers=(2, 3), head_size=3, dtype=torch.float32),
    )
)


def test_a_group_skipped_on_both_sides_leaves_the_load_unverified() -> None:
    producer, consumer = engines(
        producer_model=TWO_GROUPS_SKIPPED, consumer_model=TWO_GROUPS_SKIPPED
    )
    assert producer.workers[0, 0].skipped_groups == {1}
    t = transfer(producer, consumer, 40)
    # Its loaded KV is never compared: group 0 alone verifies nothing of it.
    assert t.load() == {"req"}
    stats = consumer.scheduler.stats
    assert (stats.verified, stats.mismatch) == (0, 0)
    assert stats.unverified == {R.SKIPPED: 1}


@pytest.mark.parametrize(
    ("producer_model", "consumer_model"),
    [
        (TWO_GROUPS_SKIPPED, TWO_GROUPS_CHECKED),
        (TWO_GROUPS_CHECKED, TWO_GROUPS_SKIPPED),
    ],
    ids=["skipped by the producer", "skipped by the consumer"],
)
def test_a_group_skipped_on_one_side_only_is_unverified(
    producer_model: ModelShape, consumer_model: ModelShape
) -> None:
    producer, consumer = engines(
        producer_model=producer_model, consumer_model=consumer_model
    )
    t = transfer(producer, consumer, 40)
    group = consumer_model.groups[1]
    assert isinstance(group, GroupShape)
    cell_bytes = group.cell_bytes

    def convert(kv: KV) -> None:
        # What the consumer's group 1 holds after the load, in its dtype.
        layers, tokens, heads, _ = kv[1].shape
        kv[1] = np.zeros((layers, tokens, heads, cell_bytes), dtype=np.uint8)

    assert t.load(corrupt=convert) == {"req"}
    assert consumer.scheduler.stats.unverified == {R.ONE_SIDE: 1}


@pytest.mark.parametrize(
    ("producer_model", "consumer_model"),
    [
        (ModelShape(num_kv_heads=4), ModelShape(num_kv_heads=2)),
        (ModelShape(num_kv_heads=2), ModelShape(num_kv_heads=4)),
        (
            ModelShape(groups=(GroupShape(layers=(0, 1, 2, 3), head_size=8),)),
            ModelShape(groups=(GroupShape(layers=(0, 1, 2, 3), head_size=4),)),
        ),
        (ModelShape(groups=(GroupShape(layers=(0, 1, 2)),)), MODEL),
    ],
    ids=["4 KV heads -> 2", "2 KV heads -> 4", "head size 8 -> 4", "3 layers -> 4"],
)
@pytest.mark.parametrize("consumer_tp", [1, 2])
def test_a_pair_serving_different_models_is_unverified_not_a_mismatch(
    producer_model: ModelShape, consumer_model: ModelShape, consumer_tp: int
) -> None:
    producer, consumer = engines(
        consumer=(consumer_tp, 1),
        producer_model=producer_model,
        consumer_model=consumer_model,
    )
    t = transfer(producer, consumer, 40)
    want = consumer_model.random_kv(0, 40)

    def convert(kv: KV) -> None:
        # What the consumer's cache holds after the load: KV of its shape.
        kv[0] = want[0]

    assert t.load(corrupt=convert) == {"req"}
    stats = consumer.scheduler.stats
    assert (stats.verified, stats.mismatch) == (0, 0)
    assert stats.unverified == {R.OTHER_LAYERS: 1}
    assert "model differs" in R.OTHER_LAYERS


@pytest.mark.parametrize("reason", [FinishReason.ABORT, FinishReason.ERROR])
def test_an_aborted_producer_sends_nothing(reason: FinishReason) -> None:
    producer, _ = engines()
    kv = MODEL.random_kv(0, 30)
    req, _ = producer.prefill("req", kv, 30)
    params = producer.finish(req, reason)
    assert KV_TRANSFER_PARAMS_KEY not in params
    assert producer.scheduler.take_kv_checksums_to_send() == {}
    assert producer.scheduler.stats.sent == 0


# --- Offloaded KV -----------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_an_offloaded_prefix_reloaded_intact_verifies(tp: int) -> None:
    engine = offload_engine(MODEL, tp=tp)
    kv = MODEL.random_kv(3, 70)
    offloaded = offload(engine, "first", kv, 70)
    assert reload(engine, "second", offloaded) == set()
    assert engine.scheduler.stats.verified == 1
    assert engine.connector.failures == []


@pytest.mark.parametrize("fail_closed", [True, False])
def test_an_offloaded_block_reloaded_with_flipped_bits_fails_and_the_connector_hears(
    fail_closed: bool,
) -> None:
    engine = offload_engine(MODEL, tp=2, fail_closed=fail_closed)
    kv = MODEL.random_kv(4, 64)
    offloaded = offload(engine, "first", kv, 64)
    failed = reload(engine, "second", offloaded, corrupt=flip(0, 3, 35, 1, 12, 6))
    assert failed == ({"second"} if fail_closed else set())
    # In both modes the connector hears of it, to drop the bad copy.
    assert engine.connector.failures == [("second", {0: [2]})]


def test_an_offloaded_block_reloaded_at_the_wrong_position_fails() -> None:
    engine = offload_engine(MODEL, tp=2)
    kv = MODEL.random_kv(5, 64)
    offloaded = offload(engine, "first", kv, 64)

    # The tier hands back block 2's KV and checksums as block 1's and v.v.
    def swap_kv(data: KV) -> None:
        data[0][:, 16:48] = np.concatenate([data[0][:, 32:48], data[0][:, 16:32]], 1)

    swapped = {
        rank: {g: v[[0, 2, 1, 3]] for g, v in stored.items()}
        for rank, stored in offloaded.stored.items()
    }
    assert reload(engine, "second", offloaded, corrupt=swap_kv, stored=swapped) == {
        "second"
    }
    assert engine.connector.failures == [("second", {0: [1, 2]})]


# --- Detection matrix -------------------------------------------------------------

NUM_TOKENS = 50  # Blocks of 16: three whole and a last of 2 tokens.
OTHER_KV = MODEL.random_kv(99, NUM_TOKENS)


def _swap(t: np.ndarray, dim: int, a: int | slice, b: int | slice) -> None:
    index_a = (*(slice(None),) * dim, a)
    index_b = (*(slice(None),) * dim, b)
    first = t[index_a].copy()
    t[index_a] = t[index_b]
    t[index_b] = first


def _changed_byte(kv: KV) -> None:
    kv[0][2, 33, 0, 5] = (int(kv[0][2, 33, 0, 5]) + 77) % 256


def _zeroed_block(kv: KV) -> None:
    kv[0][:, 16:32] = 0


def _block_of_another_request(kv: KV) -> None:
    kv[0][:, 32:48] = OTHER_KV[0][:, 32:48]


def _one_block_shift(kv: KV) -> None:
    kv[0][:, 16:] = kv[0][:, :-16].copy()


def _truncated_last_block(kv: KV) -> None:
    # The copy stopped a token short: the slot keeps what it held before.
    kv[0][:, 49] = 0


def _two_bit63_flips(kv: KV) -> None:
    # Bit 63 of both pieces (K and V) of one cell.
    kv[0][1, 7, 0, 7] ^= 0x80
    kv[0][1, 7, 0, 15] ^= 0x80


def _bit63_in_two_tokens(kv: KV) -> None:
    kv[0][1, 7, 0, 7] ^= 0x80
    kv[0][1, 8, 0, 7] ^= 0x80


DETECTED: dict[str, Callable[[KV], None]] = {
    **{
        f"bit {bit} of a piece": flip(0, 1, 21, 1, 8 + bit // 8, bit % 8)
        for bit in range(64)
    },
    "a changed byte": _changed_byte,
    "a zeroed block": _zeroed_block,
    "two swapped blocks": lambda kv: _swap(kv[0], 1, slice(0, 16), slice(16, 32)),
    "swapped tokens": lambda kv: _swap(kv[0], 1, 3, 4),
    "swapped heads": lambda kv: _swap(kv[0], 2, 0, 1),
    "swapped layers": lambda kv: _swap(kv[0], 0, 0, 1),
    "a block from another request": _block_of_another_request,
    "a one-block shift": _one_block_shift,
    "a truncated last block": _truncated_last_block,
    "bit 63 flipped in two pieces of one slice": _two_bit63_flips,
    "bit 63 flipped in two tokens": _bit63_in_two_tokens,
}


@pytest.mark.parametrize("case", list(DETECTED))
def test_corruption_is_detected(case: str) -> None:
    producer, consumer = engines(consumer=(2, 1))
    t = transfer(producer, consumer, NUM_TOKENS, seed=7)
    assert t.load(corrupt=DETECTED[case]) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


@pytest.mark.parametrize(
    "case", ["swapped heads", "bit 63 flipped in two pieces of one slice"]
)
def test_corruption_is_detected_across_block_sizes_and_replicas(case: str) -> None:
    producer, consumer = engines((2, 1), (4, 1), consumer_bs=32)
    t = transfer(producer, consumer, NUM_TOKENS, seed=8)
    assert t.load(corrupt=DETECTED[case]) == {"req"}


# --- Sliding windows between block sizes ------------------------------------------

SLIDING_BLOCK_SIZES = [(32, 16), (16, 32)]


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_BLOCK_SIZES)
def test_sliding_window_loads_between_block_sizes_verify(
    producer_bs: int, consumer_bs: int
) -> None:
    producer, consumer = engines(
        producer_bs=producer_bs,
        consumer_bs=consumer_bs,
        producer_model=SLIDING,
        consumer_model=SLIDING,
    )
    lengths = range(1, 140, 3)
    for n in lengths:
        t = transfer(producer, consumer, n, seed=n, req_id=f"r{n}")
        assert t.load() == set(), n
    stats = consumer.scheduler.stats
    assert (stats.verified, stats.mismatch, dict(stats.unverified)) == (
        len(lengths),
        0,
        {},
    )


def _window_flip(token: int) -> Callable[[KV], None]:
    """Flip a bit of ``token`` in the sliding-window group (group 1)."""
    return flip(1, 1, token, 1, 3, 5)


SLIDING_DETECTED: dict[str, Callable[[KV], None]] = {
    "a bit of the last token": _window_flip(-1),
    # The next token reads from WINDOW - 1 tokens back; a recomputed last
    # token from WINDOW back.
    "a bit of the window's first token": _window_flip(-(WINDOW - 1)),
    "a bit of the first token a recomputed last token reads": _window_flip(-WINDOW),
    "swapped tokens": lambda kv: _swap(kv[1], 1, -3, -2),
    "a zeroed 16-token span": lambda kv: kv[1][:, -20:-4].fill(0),
}


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_BLOCK_SIZES)
@pytest.mark.parametrize("num_tokens", [100, 77])
@pytest.mark.parametrize("case", list(SLIDING_DETECTED))
def test_corruption_in_a_sliding_window_is_detected_between_block_sizes(
    producer_bs: int, consumer_bs: int, num_tokens: int, case: str
) -> None:
    producer, consumer = engines(
        (2, 1),
        (1, 1),
        producer_bs=producer_bs,
        consumer_bs=consumer_bs,
        producer_model=SLIDING,
        consumer_model=SLIDING,
    )
    t = transfer(producer, consumer, num_tokens, seed=5)

    def corrupt(kv: KV) -> None:
        # Index from the end of the whole request, whatever was transferred.
        full = {
            g: np.zeros((*a.shape[:1], num_tokens, *a.shape[2:]), a.dtype)
            for g, a in kv.items()
        }
        for g, a in kv.items():
            full[g][:, num_tokens - a.shape[1] :] = a
        SLIDING_DETECTED[case](full)
        for g, a in kv.items():
            a[...] = full[g][:, num_tokens - a.shape[1] :]

    assert t.load(corrupt=corrupt) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


# The detection matrix on a sliding-window group: 4 layers, as MODEL's
# group, so the cases apply as they are; at 50 tokens a window of 40 keeps
# every block on both sides, so every token is compared.
SLIDING_WIDE = ModelShape(
    groups=(
        GroupShape(layers=(0, 1, 2, 3)),
        GroupShape(layers=(4, 5, 6, 7), sliding_window=WINDOW),
    )
)


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), SLIDING_BLOCK_SIZES)
@pytest.mark.parametrize("case", list(DETECTED))
def test_corruption_of_a_sliding_window_group_is_detected_between_block_sizes(
    producer_bs: int, consumer_bs: int, case: str
) -> None:
    producer, consumer = engines(
        (1, 1),
        (2, 1),
        producer_bs=producer_bs,
        consumer_bs=consumer_bs,
        producer_model=SLIDING_WIDE,
        consumer_model=SLIDING_WIDE,
    )
    t = transfer(producer, consumer, NUM_TOKENS, seed=7)

    def corrupt_window_group(kv: KV) -> None:
        DETECTED[case]({0: kv[1]})

    assert t.load(corrupt=corrupt_window_group) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


# --- Many clean loads -------------------------------------------------------------


NUM_CLEAN_LOADS = 1200


def test_a_thousand_clean_random_loads_all_verify() -> None:
    rng = np.random.default_rng(2024)
    total = hybrid = 0
    for i, pairing in enumerate(CLEAN_PAIRINGS):
        model, p, c, p_bs, c_bs, consumer_model = pairing
        layouts = list(KVLayout)
        # State pages per layer (as vLLM allocates them) or one tensor for
        # all layers of a group, on either side.
        state_pages: list[Literal["per_layer", "shared"]] = ["per_layer", "shared"]
        producer = SimEngine(
            model,
            tp=p[0],
            pp=p[1],
            block_size=p_bs,
            layout=layouts[i % 3],
            state_pages=state_pages[i % 2],
            seed=i,
        )
        consumer = SimEngine(
            consumer_model or model,
            tp=c[0],
            pp=c[1],
            block_size=c_bs,
            layout=layouts[(i + 1) % 3],
            state_pages=state_pages[i // 2 % 2],
            seed=100 + i,
        )
        count = NUM_CLEAN_LOADS // len(CLEAN_PAIRINGS) + (
            i < NUM_CLEAN_LOADS % len(CLEAN_PAIRINGS)
        )
        for n in range(count):
            num_tokens = int(rng.integers(1, 150))
            chunk = max(p_bs, c_bs)
            num_local = chunk * int(rng.integers(0, (num_tokens - 1) // chunk + 1))
            t = transfer(
                producer,
                consumer,
                num_tokens,
                seed=int(rng.integers(1 << 31)),
                req_id=f"r{n}",
            )
            assert t.load(num_local_tokens=num_local) == set()
            for g in model.state_groups():
                # The consumer decodes from the producer's state.
                np.testing.assert_array_equal(t.seen[g], t.kv[g])
        stats = consumer.scheduler.stats
        assert (stats.verified, stats.mismatch, dict(stats.unverified)) == (
            count,
            0,
            {},
        )
        total += count
        hybrid += count if model.state_groups() else 0
    assert (total, hybrid) == (NUM_CLEAN_LOADS, 570)
