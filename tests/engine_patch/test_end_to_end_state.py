"""Hybrid models end to end: attention groups and Mamba2 state groups, the
states in vLLM 0.32's pages, moved between TP sizes as NIXL moves them (the
producer's running-state block into the consumer's, each rank its share of
the conv state's x, B and C parts and of the SSM state's heads).

The detection matrix on the state: every fault class, applied to what the
transfer writes into the consumer's state block, fails the load as a
mismatch (fail-closed); without known TP splits only peers of one TP size
compare, and others are unverified, never a mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
from pd_models import (
    HYBRID,
    HYBRID_REPLICATED,
    HYBRID_SLIDING,
    HYBRID_UNKNOWN_SPLIT,
    engines,
)
from pd_sim import (
    KV,
    GroupShape,
    ModelShape,
    SimBlocks,
    SimEngine,
    StateGroupShape,
    Transfer,
    load_together,
    transfer,
    transfers_together,
)

from engine_patch.payload import (
    KV_TRANSFER_PARAMS_KEY,
    KVChecksumPayload,
    decode_base64,
)
from engine_patch.verify import UnverifiedReason
from engine_patch.worker import KVLayout, StateShard

R = UnverifiedReason

# The state group the matrix corrupts, its shape, and its states' places in
# a layer's unsharded form.
S = 1
SHAPE = HYBRID.groups[S]
assert isinstance(SHAPE, StateGroupShape)
CONV, SSM = SHAPE.states
(CONV_AT, CONV_BYTES), (SSM_AT, SSM_BYTES) = SHAPE.offsets
X = SHAPE.num_heads * SHAPE.head_dim
BC = SHAPE.n_groups * SHAPE.d_state
NUM_TOKENS = 50
OTHER_KV = HYBRID.random_kv(99, NUM_TOKENS)


def conv(kv: KV, layer: int) -> np.ndarray:
    """A layer's conv state, ``[conv_dim, kernel - 1, element bytes]``
    (DS), a view."""
    data = kv[S][layer, CONV_AT : CONV_AT + CONV_BYTES]
    return data.reshape(*CONV.shape, CONV.element_size)


def ssm(kv: KV, layer: int) -> np.ndarray:
    """A layer's SSM state, ``[heads, head_dim, d_state, element bytes]``,
    a view."""
    data = kv[S][layer, SSM_AT : SSM_AT + SSM_BYTES]
    return data.reshape(*SSM.shape, SSM.element_size)


def _swap(t: np.ndarray, dim: int, a: int | slice, b: int | slice) -> None:
    index_a = (*(slice(None),) * dim, a)
    index_b = (*(slice(None),) * dim, b)
    first = t[index_a].copy()
    t[index_a] = t[index_b]
    t[index_b] = first


def _swap_arrays(a: np.ndarray, b: np.ndarray) -> None:
    first = a.copy()
    a[...] = b
    b[...] = first


def _flip_conv(bit: int) -> Callable[[KV], None]:
    def corrupt(kv: KV) -> None:
        # Piece 5 of layer 1's conv state.
        kv[S][1, CONV_AT + 40 + bit // 8] ^= 1 << bit % 8

    return corrupt


def _flip_ssm(bit: int) -> Callable[[KV], None]:
    def corrupt(kv: KV) -> None:
        # Piece 11 of layer 0's SSM state.
        kv[S][0, SSM_AT + 88 + bit // 8] ^= 1 << bit % 8

    return corrupt


def _shares(state_index: int, tp: int) -> list[list[slice]]:
    """Per rank of TP ``tp``, its runs of the split dim of the state."""
    spec = (CONV, SSM)[state_index]
    return [
        [
            slice(start, start + length)
            for start, length in StateShard.split(
                spec.shape, spec.dim, tp, rank, spec.parts
            ).runs
        ]
        for rank in range(tp)
    ]


def _swapped_rank_shares(kv: KV) -> None:
    # Ranks 0 and 1 of TP 2 each get the other's share of both states.
    for view, index in ((conv(kv, 0), 0), (ssm(kv, 0), 1)):
        first, second = _shares(index, 2)
        for a, b in zip(first, second, strict=True):
            _swap(view, 0, a, b)


def _rank_share_of_another_request(kv: KV) -> None:
    # Rank 1 of TP 2 read its share of the SSM state from another request.
    for run in _shares(1, 2)[1]:
        ssm(kv, 1)[run] = ssm(OTHER_KV, 1)[run]


def _conv_one_step_behind(kv: KV) -> None:
    # The window of inputs a token earlier: each row moved up by one.
    for layer in (0, 1):
        c = conv(kv, layer)
        c[:, 1:] = c[:, :-1].copy()


def _two_bit63_flips(kv: KV) -> None:
    # Bit 63 of two pieces of one state.
    kv[S][0, SSM_AT + 7] ^= 0x80
    kv[S][0, SSM_AT + 23] ^= 0x80


def _bit63_in_two_layers(kv: KV) -> None:
    kv[S][0, SSM_AT + 15] ^= 0x80
    kv[S][1, SSM_AT + 15] ^= 0x80


def _changed_byte(kv: KV) -> None:
    kv[S][1, SSM_AT + 33] = (int(kv[S][1, SSM_AT + 33]) + 77) % 256


def _zeroed(view: Callable[[KV, int], np.ndarray]) -> Callable[[KV], None]:
    return lambda kv: view(kv, 1).fill(0)


def _zeroed_states(kv: KV) -> None:
    kv[S].fill(0)


def _state_of_another_request(kv: KV) -> None:
    kv[S] = OTHER_KV[S].copy()


def _one_layer_of_another_request(kv: KV) -> None:
    kv[S][1] = OTHER_KV[S][1]


def _truncated_ssm_state(kv: KV) -> None:
    # The copy stopped a piece short: the last one keeps what it held.
    kv[S][1, -8:] = OTHER_KV[S][1, -8:]


def _swapped_b_and_c(kv: KV) -> None:
    _swap(conv(kv, 0), 0, slice(X, X + BC), slice(X + BC, X + 2 * BC))


StateFault = Callable[[Transfer], Callable[[KV], None]]


def _scratch_block_sent(t: Transfer) -> Callable[[KV], None]:
    """The producer's speculative scratch block sent in place of its
    running state (a connector clipping the wrong block)."""

    def corrupt(kv: KV) -> None:
        scratch = t.producer_blocks.blocks[S][-1].block_id
        assert scratch != t.producer_blocks.states[S]
        kv[S] = t.producer.read_state(S, scratch)

    return corrupt


def _state_block_not_written(t: Transfer) -> Callable[[KV], None]:
    """The consumer's state block keeps what it held (the transfer wrote the
    state elsewhere, or not at all)."""

    def corrupt(kv: KV) -> None:
        kv[S] = t.consumer.read_state(S, t.consumer_blocks.states[S])

    return corrupt


def _fault(corrupt: Callable[[KV], None]) -> StateFault:
    return lambda t: corrupt


STATE_DETECTED: dict[str, StateFault] = {
    "a changed byte of the SSM state": _fault(_changed_byte),
    "a zeroed conv state": _fault(_zeroed(conv)),
    "a zeroed SSM state": _fault(_zeroed(ssm)),
    "a zeroed state of every layer": _fault(_zeroed_states),
    "the state of another request": _fault(_state_of_another_request),
    "one layer's state from another request": _fault(_one_layer_of_another_request),
    "swapped states between layers": _fault(lambda kv: _swap(kv[S], 0, 0, 1)),
    "swapped conv states between layers": _fault(
        lambda kv: _swap_arrays(conv(kv, 0), conv(kv, 1))
    ),
    "swapped SSM heads": _fault(lambda kv: _swap(ssm(kv, 0), 0, 2, 5)),
    "swapped conv channels": _fault(lambda kv: _swap(conv(kv, 1), 0, 3, 4)),
    "swapped B and C of the conv state": _fault(_swapped_b_and_c),
    "a conv state one step behind": _fault(_conv_one_step_behind),
    "a truncated SSM state (its last piece stale)": _fault(_truncated_ssm_state),
    "bit 63 flipped in two pieces of one state": _fault(_two_bit63_flips),
    "bit 63 flipped in one piece of two layers": _fault(_bit63_in_two_layers),
    "the states of two groups swapped": _fault(
        lambda kv: _swap_arrays(kv[S][0], kv[2][0])
    ),
    "TP ranks' shares swapped": _fault(_swapped_rank_shares),
    "a TP rank's share from another request": _fault(_rank_share_of_another_request),
    "the producer's scratch block sent as its state": _scratch_block_sent,
    "the consumer's state block not written": _state_block_not_written,
}


# (producer TP, PP), (consumer TP, PP), producer and consumer block sizes:
# the states' x, B, C and heads split over 1, 2 and 4 ranks either way.
MATRIX_PAIRINGS = {
    "TP 1->2, 16->32": ((1, 1), (2, 1), 16, 32),
    "TP 4->2, 32->16": ((4, 1), (2, 1), 32, 16),
    "TP 2->4, 16->16": ((2, 1), (4, 1), 16, 16),
}


def hybrid_engines(
    pairing: str, *, fail_closed: bool = True
) -> tuple[SimEngine, SimEngine]:
    p, c, p_bs, c_bs = MATRIX_PAIRINGS[pairing]
    return engines(
        p,
        c,
        producer_bs=p_bs,
        consumer_bs=c_bs,
        producer_model=HYBRID,
        consumer_model=HYBRID,
        fail_closed=fail_closed,
    )


# --- Clean loads ------------------------------------------------------------------


@pytest.mark.parametrize("consumer_tp", [1, 2, 4])
@pytest.mark.parametrize("producer_tp", [1, 2, 4])
def test_a_clean_hybrid_load_verifies_its_attention_and_state_groups(
    producer_tp: int, consumer_tp: int
) -> None:
    producer, consumer = engines(
        (producer_tp, 1),
        (consumer_tp, 1),
        producer_bs=16,
        consumer_bs=32,
        producer_model=HYBRID,
        consumer_model=HYBRID,
    )
    t = transfer(producer, consumer, NUM_TOKENS, seed=3)
    payload = KVChecksumPayload.from_bytes(
        decode_base64(t.params[KV_TRANSFER_PARAMS_KEY])  # type: ignore[arg-type]
    )
    # One value per state group: its running state, as one span.
    assert {
        g: (span, start, len(values))
        for g, (_, span, start, values) in payload.groups.items()
        if g != 0
    } == {1: (1, 0, 1), 2: (1, 0, 1)}
    assert t.load() == set()
    assert consumer.scheduler.stats.verified == 1
    for g in HYBRID.state_groups():
        np.testing.assert_array_equal(t.seen[g], t.kv[g])


@pytest.mark.parametrize("num_local_tokens", [32, 64])
def test_a_hybrid_load_after_a_prefix_hit_verifies_the_state_it_loads(
    num_local_tokens: int,
) -> None:
    producer, consumer = hybrid_engines("TP 1->2, 16->32")
    t = transfer(producer, consumer, 70, seed=4)
    assert t.load(num_local_tokens=num_local_tokens) == set()
    assert consumer.scheduler.stats.verified == 1


# --- The detection matrix on the state --------------------------------------------


@pytest.mark.parametrize("pairing", list(MATRIX_PAIRINGS))
@pytest.mark.parametrize("case", list(STATE_DETECTED))
def test_state_corruption_is_detected(case: str, pairing: str) -> None:
    producer, consumer = hybrid_engines(pairing)
    t = transfer(producer, consumer, NUM_TOKENS, seed=7)
    assert t.load(corrupt=STATE_DETECTED[case](t)) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1
    # The state's block (position 0) of the corrupted group(s), nothing else.
    where = "group 1 block positions [0]"
    if case == "the states of two groups swapped":
        where += "; group 2 block positions [0]"
    assert f"({where})" in consumer.scheduler.take_load_failures()["req"]


@pytest.mark.parametrize("state", ["conv", "SSM"])
def test_every_bit_of_a_piece_of_a_state_is_detected(state: str) -> None:
    producer, consumer = hybrid_engines("TP 4->2, 32->16")
    missed = []
    for bit in range(64):
        t = transfer(producer, consumer, NUM_TOKENS, seed=bit, req_id=f"r{bit}")
        corrupt = _flip_conv(bit) if state == "conv" else _flip_ssm(bit)
        if t.load(corrupt=corrupt) != {f"r{bit}"}:
            missed.append(bit)
    assert missed == []
    assert consumer.scheduler.stats.mismatch == 64


@pytest.mark.parametrize("pairing", list(MATRIX_PAIRINGS))
def test_a_corrupted_state_after_a_prefix_hit_fails(pairing: str) -> None:
    producer, consumer = hybrid_engines(pairing)
    t = transfer(producer, consumer, 70, seed=5)
    assert t.load(num_local_tokens=32, corrupt=_flip_ssm(9)) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


def test_a_corrupted_state_is_logged_used_and_kept_from_reuse_under_fail_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    producer, consumer = hybrid_engines("TP 1->2, 16->32", fail_closed=False)
    t = transfer(producer, consumer, NUM_TOKENS, seed=6)
    with caplog.at_level(logging.ERROR, logger="kvguard.engine_patch.scheduler"):
        assert t.load(corrupt=_flip_conv(17)) == set()
    assert consumer.scheduler.stats.mismatch == 1
    assert "group 1 block positions [0] (fail-open: the load is used)" in caplog.text
    # The request decodes from the state it loaded, as loaded.
    assert not np.array_equal(t.seen[S], t.kv[S])


# --- Replicated states ------------------------------------------------------------


def test_a_corrupted_copy_of_a_replicated_state_fails() -> None:
    # TP 2 over a state every rank holds whole: rank 1 holds copy 1.
    producer, consumer = engines(
        (1, 1),
        (2, 1),
        producer_model=HYBRID_REPLICATED,
        consumer_model=HYBRID_REPLICATED,
    )
    (cache,) = [c for c in consumer.state_caches[0, 1] if c.slot == 0]
    assert (cache.layer.replicas, cache.layer.replica_index) == (2, 1)
    t = transfer(producer, consumer, NUM_TOKENS, seed=8)

    def corrupt_second_copy(engine: SimEngine, blocks: SimBlocks) -> None:
        cache.pages[blocks.states[S], 100] ^= 0x04

    assert t.load(corrupt_cache=corrupt_second_copy) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


# --- States of unknown TP split ---------------------------------------------------


@pytest.mark.parametrize("case", list(STATE_DETECTED))
def test_state_corruption_without_tp_splits_is_detected_between_equal_tp_sizes(
    case: str,
) -> None:
    model = ModelShape(
        groups=(
            *HYBRID_UNKNOWN_SPLIT.groups,
            StateGroupShape(layers=(4, 5), known_split=False),
        )
    )
    producer, consumer = engines(
        (2, 1), (2, 1), producer_model=model, consumer_model=model, consumer_bs=32
    )
    t = transfer(producer, consumer, NUM_TOKENS, seed=9)
    assert t.load(corrupt=STATE_DETECTED[case](t)) == {"req"}
    assert consumer.scheduler.stats.mismatch == 1


@pytest.mark.parametrize(("producer_tp", "consumer_tp"), [(1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("corrupted", [False, True], ids=["clean", "corrupted"])
def test_states_without_tp_splits_between_tp_sizes_are_unverified_never_a_mismatch(
    producer_tp: int, consumer_tp: int, corrupted: bool
) -> None:
    producer, consumer = engines(
        (producer_tp, 1),
        (consumer_tp, 1),
        producer_model=HYBRID_UNKNOWN_SPLIT,
        consumer_model=HYBRID_UNKNOWN_SPLIT,
    )
    t = transfer(producer, consumer, NUM_TOKENS, seed=10)
    assert t.load(corrupt=_flip_ssm(3) if corrupted else None) == {"req"}
    stats = consumer.scheduler.stats
    assert (stats.verified, stats.mismatch) == (0, 0)
    assert stats.unverified == {R.MAMBA_TP: 1}
    assert (
        f"group 1: producer TP {producer_tp}, consumer TP {consumer_tp}"
        in consumer.scheduler.take_load_failures()["req"]
    )


# --- Sliding windows and states ---------------------------------------------------


@pytest.mark.parametrize(("producer_bs", "consumer_bs"), [(16, 32), (32, 16)])
@pytest.mark.parametrize("group", ["sliding window", "state"])
def test_corruption_of_a_sliding_window_or_state_group_of_one_model_is_detected(
    producer_bs: int, consumer_bs: int, group: str
) -> None:
    producer, consumer = engines(
        (1, 1),
        (2, 1),
        producer_bs=producer_bs,
        consumer_bs=consumer_bs,
        producer_model=HYBRID_SLIDING,
        consumer_model=HYBRID_SLIDING,
    )
    t = transfer(producer, consumer, 100, seed=11)
    # The window's last token, or a byte of the SSM state.
    g, index = (1, (0, -1, 1, 3)) if group == "sliding window" else (2, (1, 400))

    def corrupt(kv: KV) -> None:
        kv[g][index] ^= 0x20

    assert t.load(corrupt=corrupt) == {"req"}
    assert (
        f"(group {g} block positions"
        in (consumer.scheduler.take_load_failures()["req"])
    )


# --- States no worker can checksum ------------------------------------------------

# TP 2 splits the conv state's x part (12 channels of 3 bf16) in shares of 36
# bytes, not whole 8-byte pieces: no worker checksums the group.
UNALIGNED = ModelShape(
    groups=(
        GroupShape(layers=(0, 3)),
        StateGroupShape(layers=(1, 2), num_heads=4, head_dim=3, n_groups=2, d_state=8),
    )
)


@pytest.mark.parametrize(
    ("producer_tp", "reason", "detail"),
    [(2, R.SKIPPED, "(group 1)"), (1, R.ONE_SIDE, "(group 1 on the producer only)")],
    ids=["TP 2->2", "TP 1->2"],
)
@pytest.mark.parametrize("corrupted", [False, True], ids=["clean", "corrupted"])
def test_a_loaded_state_group_no_worker_can_checksum_leaves_the_load_unverified(
    corrupted: bool, producer_tp: int, reason: UnverifiedReason, detail: str
) -> None:
    producer, consumer = engines(
        (producer_tp, 1), (2, 1), producer_model=UNALIGNED, consumer_model=UNALIGNED
    )
    assert {w.skipped_groups for w in consumer.workers.values()} == {frozenset({1})}
    t = transfer(producer, consumer, NUM_TOKENS, seed=12)

    def corrupt(kv: KV) -> None:
        kv[1][0, 5] ^= 1

    assert t.load(corrupt=corrupt if corrupted else None) == {"req"}
    stats = consumer.scheduler.stats
    assert (stats.verified, stats.mismatch) == (0, 0)
    assert stats.unverified == {reason: 1}
    assert detail in consumer.scheduler.take_load_failures()["req"]


# --- Several loads in one step ----------------------------------------------------


def test_loads_finishing_in_one_step_are_verified_each_on_its_own() -> None:
    producer, consumer = hybrid_engines("TP 4->2, 32->16")
    lengths = [1, 17, 50, 64, 33, 70]
    transfers = transfers_together(
        producer, consumer, [(f"r{i}", n, 20 + i) for i, n in enumerate(lengths)]
    )

    def flip_byte(g: int, index: tuple[int, ...]) -> Callable[[KV], None]:
        def corrupt(kv: KV) -> None:
            kv[g][index] ^= 0x10

        return corrupt

    failed, mismatched = load_together(
        transfers,
        {
            "r1": flip_byte(1, (0, 300)),
            "r3": flip_byte(0, (1, 40, 0, 3)),
            "r4": flip_byte(2, (1, 0)),
        },
    )
    assert failed == {"r1", "r3", "r4"}
    # Token 40 is in the producer's block 1 of 32 tokens: consumer blocks 2, 3.
    assert mismatched == {"r1": {1: [0]}, "r3": {0: [2, 3]}, "r4": {2: [0]}}
    stats = consumer.scheduler.stats
    assert (stats.verified, stats.mismatch, dict(stats.unverified)) == (3, 3, {})


def _random_fault(
    rng: np.random.Generator, model: ModelShape, num_tokens: int
) -> tuple[int, Callable[[KV], None]]:
    """A random corruption of one group of a transfer: a flipped bit of its
    state, or of a token the request reads (for a sliding window, one of the
    last ``window - 1``), or a state of another request or of another layer."""
    g = int(rng.integers(len(model.groups)))
    group = model.groups[g]
    kind = int(rng.integers(3)) if isinstance(group, StateGroupShape) else 0
    other = model.random_kv(int(rng.integers(1 << 30)), num_tokens)[g]
    where = int(rng.integers(1 << 30))

    def corrupt(kv: KV) -> None:
        data = kv[g]
        if kind == 1:
            kv[g] = other
        elif kind == 2:
            data[[0, 1]] = data[[1, 0]]
        else:
            if isinstance(group, GroupShape) and group.sliding_window:
                data = data[:, -(group.sliding_window - 1) :]
            index = np.unravel_index(where % data.size, data.shape)
            data[index] ^= 1 << where % 8

    return g, corrupt


def test_random_corruptions_of_hybrid_loads_finishing_together_are_all_caught() -> None:
    rng = np.random.default_rng(2025)
    outcomes = {"caught": 0, "missed": 0, "verified": 0, "failed clean": 0}
    for i in range(9):
        model = (HYBRID, HYBRID_SLIDING, HYBRID_REPLICATED)[i % 3]
        producer = SimEngine(
            model,
            tp=int(rng.choice([1, 2, 4])),
            block_size=int(rng.choice([16, 32])),
            num_blocks=200,
            seed=i,
        )
        consumer = SimEngine(
            model,
            tp=int(rng.choice([1, 2, 4])),
            block_size=int(rng.choice([16, 32])),
            layout=KVLayout.PACKED_NHD,
            num_blocks=200,
            seed=50 + i,
        )
        for step in range(5):
            requests = [
                (f"s{step}r{n}", int(rng.integers(1, 150)), int(rng.integers(1 << 30)))
                for n in range(int(rng.integers(1, 7)))
            ]
            transfers = transfers_together(producer, consumer, requests)
            faults = {
                t.req_id: _random_fault(rng, model, t.num_tokens)
                for t in transfers
                if rng.random() < 0.5
            }
            failed, mismatched = load_together(
                transfers, {req_id: corrupt for req_id, (_, corrupt) in faults.items()}
            )
            for t in transfers:
                if t.req_id in faults:
                    g = faults[t.req_id][0]
                    outcomes[
                        "caught" if g in mismatched.get(t.req_id, {}) else "missed"
                    ] += 1
                else:
                    outcomes["failed clean" if t.req_id in failed else "verified"] += 1
    assert outcomes["missed"] == outcomes["failed clean"] == 0, outcomes
    assert outcomes["caught"] > 50 and outcomes["verified"] > 50, outcomes
