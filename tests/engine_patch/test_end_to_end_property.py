"""KVGuard's promise as a property over simulated engines: a consumer uses a
load only if it holds the producer's KV wherever it reads.

Hypothesis draws a producer and a consumer (model, TP/PP split, block
sizes, memory layouts), up to three requests loaded in one step (lengths,
locally cached prefixes) and changes to what each transfer carries: flipped
bits, swapped tokens, zeroed spans. A load whose consumer then reads any
other byte than the producer's must fail (fail-closed) or be counted a
mismatch (fail-open); a load fails only if its own transfer was changed.
Afterwards neither engine holds anything of the finished requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_models import CLEAN_PAIRINGS, MODEL, CleanPairing
from pd_sim import (
    KV,
    GroupShape,
    ModelShape,
    SimEngine,
    load_together,
    offload,
    offload_engine,
    reload,
    transfers_together,
)

from engine_patch.worker import KVLayout


@dataclass(frozen=True)
class Flip:
    """XOR ``mask`` into one byte of group ``group``'s transferred KV."""

    group: int
    index: tuple[int, ...]
    mask: int

    def apply(self, kv: KV) -> None:
        kv[self.group][self.index] ^= self.mask


@dataclass(frozen=True)
class SwapTokens:
    """Swap two transferred tokens (every layer and head) of an attention
    group: KV written to the wrong slots."""

    group: int
    first: int
    second: int

    def apply(self, kv: KV) -> None:
        a = kv[self.group]
        a[:, [self.first, self.second]] = a[:, [self.second, self.first]]


@dataclass(frozen=True)
class ZeroTokens:
    """Zero transferred tokens ``[start, end)`` of an attention group: a
    write that never landed in a fresh cache."""

    group: int
    start: int
    end: int

    def apply(self, kv: KV) -> None:
        kv[self.group][:, self.start : self.end] = 0


Change = Flip | SwapTokens | ZeroTokens


@dataclass(frozen=True)
class Load:
    """One request's load: its prompt length, the prefix the consumer has
    computed itself, and the changes to what the transfer carries."""

    num_tokens: int
    num_local_tokens: int
    changes: tuple[Change, ...]


@dataclass(frozen=True)
class Scenario:
    pairing: CleanPairing
    layouts: tuple[KVLayout, KVLayout]
    state_pages: tuple[Literal["per_layer", "shared"], ...]
    fail_closed: bool
    loads: tuple[Load, ...]


def _changes(model: ModelShape, num_tokens: int) -> st.SearchStrategy[Change]:
    """Changes to the transfer of ``num_tokens`` tokens of ``model``'s KV."""
    options: list[st.SearchStrategy[Change]] = []
    for g, group in enumerate(model.groups):
        layers = st.integers(0, len(group.layers) - 1)
        masks = st.integers(1, 255)
        if not isinstance(group, GroupShape):
            options.append(
                st.builds(
                    Flip,
                    st.just(g),
                    st.tuples(layers, st.integers(0, group.nbytes - 1)),
                    masks,
                )
            )
            continue
        tokens = st.integers(0, num_tokens - 1)
        cell = st.tuples(
            layers,
            tokens,
            st.integers(0, model.num_kv_heads - 1),
            st.integers(0, group.cell_bytes - 1),
        )
        options.append(st.builds(Flip, st.just(g), cell, masks))
        options.append(st.builds(SwapTokens, st.just(g), tokens, tokens))
        options.append(
            st.tuples(tokens, tokens).map(
                lambda ends, g=g: ZeroTokens(g, min(ends), max(ends) + 1)
            )
        )
    return st.one_of(options)


@st.composite
def _load(draw: st.DrawFn, pairing: CleanPairing) -> Load:
    num_tokens = draw(st.integers(1, 120))
    chunk = max(pairing.producer_bs, pairing.consumer_bs)
    num_local = chunk * draw(st.integers(0, (num_tokens - 1) // chunk))
    changes = draw(
        st.lists(_changes(pairing.model, num_tokens - num_local), max_size=3)
    )
    return Load(num_tokens, num_local, tuple(changes))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    pairing = draw(st.sampled_from(CLEAN_PAIRINGS))
    pages = st.sampled_from(["per_layer", "shared"])
    return Scenario(
        pairing,
        (draw(st.sampled_from(KVLayout)), draw(st.sampled_from(KVLayout))),
        (draw(pages), draw(pages)),
        draw(st.booleans()),
        tuple(draw(st.lists(_load(pairing), min_size=1, max_size=3))),
    )


def _reads_other_kv(model: ModelShape, seen: KV, produced: KV, n: int) -> bool:
    """Whether the consumer's KV ``seen`` differs from the producer's
    anywhere the consumer reads: every token of a full-attention group, the
    last ``sliding_window`` tokens of a sliding-window group (a recomputed
    last token reads that far back), a state group's running state."""
    for g, group in enumerate(model.groups):
        if not isinstance(group, GroupShape):
            same = np.array_equal(seen[g], produced[g])
        else:
            window = group.sliding_window
            start = 0 if window is None else max(0, n - window)
            same = np.array_equal(seen[g][:, start:], produced[g][:, start:])
        if not same:
            return True
    return False


def _corruption(load: Load, altered: set[str], req_id: str) -> Callable[[KV], None]:
    """Apply ``load``'s changes to a transfer, noting ``req_id`` in
    ``altered`` if they changed a byte."""

    def corrupt(kv: KV) -> None:
        before = {g: a.copy() for g, a in kv.items()}
        for change in load.changes:
            change.apply(kv)
        if any(not np.array_equal(before[g], kv[g]) for g in kv):
            altered.add(req_id)

    return corrupt


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_a_load_is_used_only_if_the_consumer_reads_the_producers_kv(
    scenario: Scenario,
) -> None:
    model, p, c, p_bs, c_bs, consumer_model = scenario.pairing
    producer = SimEngine(
        model,
        tp=p[0],
        pp=p[1],
        block_size=p_bs,
        layout=scenario.layouts[0],
        state_pages=scenario.state_pages[0],
        seed=1,
    )
    consumer = SimEngine(
        consumer_model or model,
        tp=c[0],
        pp=c[1],
        block_size=c_bs,
        layout=scenario.layouts[1],
        state_pages=scenario.state_pages[1],
        fail_closed=scenario.fail_closed,
        seed=2,
    )
    loads = {f"r{i}": load for i, load in enumerate(scenario.loads)}
    transfers = transfers_together(
        producer,
        consumer,
        [
            (req_id, load.num_tokens, seed)
            for seed, (req_id, load) in enumerate(loads.items())
        ],
    )
    altered: set[str] = set()
    failed, mismatched = load_together(
        transfers,
        {req_id: _corruption(load, altered, req_id) for req_id, load in loads.items()},
        {req_id: load.num_local_tokens for req_id, load in loads.items()},
    )

    misread = {
        t.req_id
        for t in transfers
        if _reads_other_kv(model, t.seen, t.kv, t.num_tokens)
    }
    stats = consumer.scheduler.stats
    assert misread <= altered
    assert (stats.verified + stats.mismatch, dict(stats.unverified)) == (len(loads), {})
    if scenario.fail_closed:
        assert misread <= failed <= altered
        assert set(mismatched) == failed
        assert stats.mismatch == len(failed)
    else:
        assert failed == set()
        assert len(misread) <= stats.mismatch <= len(altered)

    # Every request has finished: once the host has taken the outcomes,
    # nothing of them is held.
    for engine in (producer, consumer):
        engine.scheduler.take_kv_checksums_to_send()
        engine.scheduler.take_load_failures()
        engine.scheduler.take_uncompared_blocks()
        assert engine.scheduler.held_request_ids() == set()
        assert all(not w.held_request_ids() for w in engine.workers.values())


@st.composite
def _reloads(draw: st.DrawFn) -> tuple[int, int, int, tuple[Change, ...]]:
    """(TP size, block size, whole blocks offloaded, changes to the KV the
    tier hands back)."""
    block_size = draw(st.sampled_from([16, 32]))
    num_tokens = block_size * draw(st.integers(1, 4))
    changes = draw(st.lists(_changes(MODEL, num_tokens), max_size=3))
    return draw(st.sampled_from([1, 2, 4])), block_size, num_tokens, tuple(changes)


@settings(max_examples=60, deadline=None)
@given(_reloads())
def test_a_reload_of_offloaded_kv_fails_exactly_on_the_blocks_that_changed(
    reload_case: tuple[int, int, int, tuple[Change, ...]],
) -> None:
    tp, block_size, num_tokens, changes = reload_case
    engine = offload_engine(MODEL, tp=tp, block_size=block_size)
    offloaded = offload(engine, "first", MODEL.random_kv(tp, num_tokens), num_tokens)
    before = offloaded.kv[0].copy()
    changed: set[int] = set()

    def corrupt(kv: KV) -> None:
        for change in changes:
            change.apply(kv)
        # The blocks whose tokens now differ, in any layer, head or byte.
        differs = (kv[0] != before).any(axis=(0, 2, 3))
        changed.update(np.flatnonzero(differs) // block_size)

    failed = reload(engine, "second", offloaded, corrupt=corrupt)

    assert failed == ({"second"} if changed else set())
    expected = [("second", {0: sorted(changed)})] if changed else []
    assert engine.connector.failures == expected
