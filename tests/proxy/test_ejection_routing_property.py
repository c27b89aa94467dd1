"""Property-based tests of the integrity tracker, the router and the policies.

The example tests in test_units.py pin single scenarios; these run the same
code through arbitrary sequences (record_success, record_failure, forget,
clock advances, instances back from cooldown, picks) and check what the
modules' docstrings promise after every step.

Budget: this file runs in ``make test`` on a loaded 2-core machine, so each
property runs few examples (``_QUICK``, ``_ROUTING``, ``_STATEFUL``; a few
seconds in all): enough to reach the interesting interleavings most runs,
not an exhaustive search. Raise them locally when changing the tracker or
the router.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from proxy.config import EjectionConfig
from proxy.ejection import Ejection, IntegrityTracker
from proxy.instances import Instance, Pool
from proxy.policy import least_inflight, power_of_two
from proxy.routing import Router

# deadline=None: a loaded 2-core machine stalls single examples.
_QUICK = settings(max_examples=60, deadline=None)
# Router examples are cheap and the interesting ones (probes off, a cooldown
# just over, pairs out) are rare combinations: many more of them.
_ROUTING = settings(max_examples=300, deadline=None)
_STATEFUL = settings(max_examples=100, stateful_step_count=40, deadline=None)


class Clock:
    """An injected monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_urls = itertools.count()


def instance(role: str, weight: float = 1.0) -> Instance:
    """A fresh instance with a URL no other instance in the run has."""
    return Instance(f"http://{role}-{next(_urls)}:1", role, "m", weight)  # type: ignore[arg-type]


def come_back(instances: Sequence[Instance], now: float) -> None:
    """Ends the ejections whose cooldown is over, as a passing probe (or, without
    probes, the router) does."""
    for inst in instances:
        if inst.ejected and now >= inst.ejected_until:
            inst.ejected_until = 0.0


class Fleet(RuleBasedStateMachine):
    """A tracker on a hand-advanced clock over a small fleet; its
    instances' cooldowns end as a passing probe ends them."""

    def build(self, config: EjectionConfig, n_prefills: int, n_decodes: int) -> None:
        self.clock = Clock()
        self.config = config
        self.tracker = IntegrityTracker(config, self.clock)
        self.prefills = [instance("prefill") for _ in range(n_prefills)]
        self.decodes = [instance("decode") for _ in range(n_decodes)]

    def everyone(self) -> list[Instance]:
        return self.prefills + self.decodes

    @rule()
    def cooldowns_end(self) -> None:
        come_back(self.everyone(), self.clock.now)


# ------------------------------------------------------- tracker bookkeeping


class TrackerBookkeeping(Fleet):
    """Arbitrary loads, failures, removals and clock advances on a small fleet.

    Checks the tracker's internal records against what its events imply;
    with ejection disabled, also that nothing is ever ejected.
    """

    @initialize(
        enabled=st.booleans(),
        window=st.sampled_from([10.0, 60.0]),
        instance_failures=st.integers(1, 4),
        pair_failures=st.integers(1, 3),
        cooldown=st.sampled_from([5.0, 30.0, 100.0]),
        n_prefills=st.integers(1, 3),
        n_decodes=st.integers(1, 3),
    )
    def start(
        self,
        enabled: bool,
        window: float,
        instance_failures: int,
        pair_failures: int,
        cooldown: float,
        n_prefills: int,
        n_decodes: int,
    ) -> None:
        config = EjectionConfig(
            enabled=enabled,
            window_s=window,
            instance_failures=instance_failures,
            pair_failures=pair_failures,
            cooldown_s=cooldown,
        )
        # Every instance ever made, removed ones included: requests outlive them.
        self.build(config, n_prefills, n_decodes)
        self.last_failure: float | None = None

    # Bursts reach the thresholds (and the clean counts that clear) sooner.
    @rule(
        p=st.integers(0, 9),
        d=st.integers(0, 9),
        failed=st.booleans(),
        times=st.sampled_from([1, 1, 4]),
    )
    def load(self, p: int, d: int, failed: bool, times: int) -> None:
        prefill = self.prefills[p % len(self.prefills)]
        decode = self.decodes[d % len(self.decodes)]
        now = self.clock.now
        for _ in range(times):
            if failed:
                self.last_failure = now
                out = self.tracker.record_failure(prefill, decode)
            else:
                out = self.tracker.record_success(prefill, decode)
            if not self.config.enabled:
                assert out == []
            for e in out:
                self.check_ejection(e, now)

    def check_ejection(self, e: Ejection, now: float) -> None:
        assert e.until == now + self.config.cooldown_s
        assert not e.instance.removed
        if e.partner is None:
            assert e.instance.ejected and e.instance.ejected_until == e.until
            assert e.failures >= self.config.instance_failures
        else:
            assert not e.partner.removed
            assert self.tracker.pair_ejected(e.instance, e.partner)
            assert not (e.instance.ejected or e.partner.ejected)
            assert e.failures >= self.config.pair_failures

    @rule(fraction=st.sampled_from([0.1, 0.5, 0.99, 1.0, 1.01, 2.5]))
    def advance(self, fraction: float) -> None:
        self.clock.now += fraction * self.config.window_s

    @rule(which=st.integers(0, 9), replace=st.booleans())
    def remove(self, which: int, replace: bool) -> None:
        """As a reload, the admin API or DNS does: mark it removed, then forget."""
        live = [i for i in self.everyone() if not i.removed]
        if not live:
            return
        gone = live[which % len(live)]
        gone.removed = True
        self.tracker.forget(gone)
        if replace:
            pool = self.prefills if gone.role == "prefill" else self.decodes
            pool.append(instance(gone.role))

    @rule(which=st.integers(0, 9))
    def look(self, which: int) -> None:
        """``blamed`` prunes: afterwards only the window's failures remain."""
        everyone = self.everyone()
        inst = everyone[which % len(everyone)]
        blamed = self.tracker.blamed(inst)
        now, window = self.clock.now, self.config.window_s
        failures = self.tracker._failures
        assert all(t >= now - window for t, _, _ in failures)
        own = sum(1 for _, p, d in failures if inst in (p, d))
        assert 0 <= blamed <= own
        if self.last_failure is None or now - self.last_failure > window:
            assert not failures and not self.tracker._failed

    @invariant()
    def failure_counts_mirror_the_window(self) -> None:
        expected: dict[Instance, dict[Instance, int]] = {}
        for _, p, d in self.tracker._failures:
            for a, b in ((p, d), (d, p)):
                expected.setdefault(a, {})
                expected[a][b] = expected[a].get(b, 0) + 1
        # Equality also rules out zero entries and empty partner maps.
        assert self.tracker._failed == expected

    @invariant()
    def failures_are_in_time_order_and_involve_no_ejected_instance(self) -> None:
        times = [t for t, _, _ in self.tracker._failures]
        assert times == sorted(times)
        for _, p, d in self.tracker._failures:
            assert not (p.ejected or d.ejected)

    @invariant()
    def nothing_remains_of_a_removed_instance(self) -> None:
        t = self.tracker
        for gone in (i for i in self.everyone() if i.removed):
            assert all(gone not in (p, d) for _, p, d in t._failures)
            assert gone not in t._failed
            assert all(gone not in partners for partners in t._failed.values())
            assert gone not in t._clean
            assert all(gone not in partners for partners in t._clean.values())
            assert all(gone not in pair for pair in t._pairs)

    @invariant()
    def a_pairs_clean_counter_is_shared_both_ways(self) -> None:
        for a, partners in self.tracker._clean.items():
            for b, counter in partners.items():
                assert a.role != b.role
                assert self.tracker._clean[b][a] is counter

    @invariant()
    def disabled_ejection_ejects_nothing(self) -> None:
        if not self.config.enabled:
            assert not any(i.ejections for i in self.everyone())
            assert not self.tracker.has_ejected_pairs()


TestTrackerBookkeepingStaysConsistent = TrackerBookkeeping.TestCase
TestTrackerBookkeepingStaysConsistent.settings = _STATEFUL


# ------------------------------------------------------- deterministic faults


class DeterministicFaults(Fleet):
    """At most one faulty instance per pool; a load fails iff it touches one.

    Then a healthy instance fails only with its one faulty partner, and the
    faulty one never loads cleanly: the evidence never points at a healthy
    instance (its fault cannot "follow" it to other partners, and its faulty
    partner is never "cleared"), whatever the order of the loads.
    """

    @initialize(
        n_prefills=st.integers(1, 3),
        n_decodes=st.integers(1, 3),
        faulty=st.sampled_from(["prefill", "decode", "both"]),
        instance_failures=st.integers(1, 4),
        pair_failures=st.integers(1, 6),
        cooldown=st.sampled_from([5.0, 30.0]),
    )
    def start(
        self,
        n_prefills: int,
        n_decodes: int,
        faulty: str,
        instance_failures: int,
        pair_failures: int,
        cooldown: float,
    ) -> None:
        config = EjectionConfig(
            window_s=60.0,
            instance_failures=instance_failures,
            pair_failures=pair_failures,
            cooldown_s=cooldown,
        )
        self.build(config, n_prefills, n_decodes)
        self.faulty: set[Instance] = set()
        if faulty in ("prefill", "both"):
            self.faulty.add(self.prefills[0])
        if faulty in ("decode", "both"):
            self.faulty.add(self.decodes[0])
        self.lone = n_prefills == n_decodes == 1

    # A burst of loads on one pair builds the clean counts that clear a partner.
    @rule(p=st.integers(0, 2), d=st.integers(0, 2), times=st.sampled_from([1, 1, 15]))
    def load(self, p: int, d: int, times: int) -> None:
        prefill = self.prefills[p % len(self.prefills)]
        decode = self.decodes[d % len(self.decodes)]
        for _ in range(times):
            if prefill in self.faulty or decode in self.faulty:
                out = self.tracker.record_failure(prefill, decode)
            else:
                out = self.tracker.record_success(prefill, decode)
            for e in out:
                assert e.partner is not None or e.instance in self.faulty

    @rule(seconds=st.sampled_from([1.0, 10.0, 31.0, 61.0]))
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def a_healthy_instance_is_never_blamed_nor_ejected(self) -> None:
        for inst in self.everyone():
            if inst not in self.faulty:
                assert inst.ejections == 0
                assert self.tracker.blamed(inst) == 0

    @invariant()
    def a_pair_of_healthy_instances_is_never_ejected(self) -> None:
        for p in self.prefills:
            for d in self.decodes:
                if p not in self.faulty and d not in self.faulty:
                    assert not self.tracker.pair_ejected(p, d)

    @invariant()
    def an_instance_is_ejected_once_its_blame_reaches_the_threshold(self) -> None:
        for inst in self.everyone():
            if not inst.ejected:
                assert self.tracker.blamed(inst) < self.config.instance_failures

    @invariant()
    def a_lone_pair_ejects_neither_instance(self) -> None:
        if self.lone:
            assert not any(i.ejections for i in self.everyone())


TestDeterministicFaultsNeverEjectAHealthyInstance = DeterministicFaults.TestCase
TestDeterministicFaultsNeverEjectAHealthyInstance.settings = _STATEFUL


@_QUICK
@given(
    role=st.sampled_from(["prefill", "decode"]),
    n_own=st.integers(1, 3),
    n_partners=st.integers(2, 3),
    instance_failures=st.integers(1, 5),
    pair_failures=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_a_faulty_instance_with_two_partners_is_ejected_within_a_few_rounds(
    role: str,
    n_own: int,
    n_partners: int,
    instance_failures: int,
    pair_failures: int,
    seed: int,
) -> None:
    """Loads spread over every pair, in any order: a faulty instance fails with
    at least two partners, so the fault follows it (and nobody else)."""
    other = "decode" if role == "prefill" else "prefill"
    own = [instance(role) for _ in range(n_own)]
    partners = [instance(other) for _ in range(n_partners)]
    bad = own[0]
    config = EjectionConfig(
        instance_failures=instance_failures, pair_failures=pair_failures
    )
    tracker = IntegrityTracker(config, Clock())
    pairs = [(a, b) if role == "prefill" else (b, a) for a in own for b in partners]
    rng = random.Random(seed)
    ejected: list[Instance] = []
    for _ in range(instance_failures + 2):
        rng.shuffle(pairs)
        for p, d in pairs:
            record = tracker.record_failure if bad in (p, d) else tracker.record_success
            ejected += [e.instance for e in record(p, d) if e.partner is None]
    assert ejected == [bad]


@_QUICK
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([0.0, 1.0, 20.0, 59.0, 61.0]), st.booleans()),
        max_size=40,
    ),
    pair_failures=st.integers(1, 5),
    cooldown=st.sampled_from([5.0, 30.0, 100.0]),
)
def test_a_lone_pair_ejects_only_the_pair_when_its_window_holds_pair_failures(
    steps: list[tuple[float, bool]], pair_failures: int, cooldown: float
) -> None:
    """One prefill, one decode, any outcomes: neither instance is ever blamed;
    the pair is out from the failure that brings its window to pair_failures
    until the cooldown after it."""
    clock = Clock()
    config = EjectionConfig(
        window_s=60.0,
        instance_failures=1,
        pair_failures=pair_failures,
        cooldown_s=cooldown,
    )
    tracker = IntegrityTracker(config, clock)
    p, d = instance("prefill"), instance("decode")
    failures: list[float] = []
    out_until = 0.0
    for seconds, failed in steps:
        clock.now += seconds
        now = clock.now
        if failed:
            failures.append(now)
            out = tracker.record_failure(p, d)
            in_window = sum(1 for t in failures if t >= now - config.window_s)
            if in_window >= pair_failures and now >= out_until:
                assert out == [Ejection(p, d, in_window, now + cooldown)]
                out_until = now + cooldown
            else:
                assert out == []
        else:
            assert tracker.record_success(p, d) == []
        assert not (p.ejected or d.ejected)
        assert tracker.blamed(p) == tracker.blamed(d) == 0
        assert tracker.pair_ejected(p, d) == (now < out_until)


# ------------------------------------------------------------------ routing


@dataclass
class Shape:
    """An instance's state for routing: health, drain, removal, ejection."""

    healthy: bool
    drained: bool
    removed: bool
    ejection: str  # "none", "active" or "over" (cooldown ended, not yet noticed)
    weight: float
    in_flight: int

    def __repr__(self) -> str:
        flags = [
            f
            for f, on in (
                ("unhealthy", not self.healthy),
                ("drained", self.drained),
                ("removed", self.removed),
            )
            if on
        ]
        if self.ejection != "none":
            flags.append(f"ejected({self.ejection})")
        return " ".join([*flags, f"w={self.weight}", f"in_flight={self.in_flight}"])


shapes = st.builds(
    Shape,
    healthy=st.sampled_from([True, True, True, False]),
    drained=st.sampled_from([False, False, False, True]),
    removed=st.sampled_from([False, False, False, False, True]),
    ejection=st.sampled_from(["none", "active", "over"]),
    weight=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    in_flight=st.integers(0, 4),
)


def shape(inst: Instance, state: Shape, now: float) -> Instance:
    """Gives ``inst`` the routing state ``state`` (its ejection relative to ``now``)."""
    inst.healthy, inst.drained, inst.removed = (
        state.healthy,
        state.drained,
        state.removed,
    )
    inst.weight, inst.in_flight = state.weight, state.in_flight
    if state.ejection == "active":
        inst.ejected_until = now + 10
    elif state.ejection == "over":
        inst.ejected_until = now - 1
    return inst


def best_choices(
    router: Router,
    pool: Pool,
    avoid: frozenset[Instance],
    partner: Instance | None,
    partners: Pool | None,
    probing: bool,
) -> list[Instance]:
    """What routing.py's docstring allows, best group first: usable, not
    ejected, pair not ejected; then ignoring the pair; then ejected ones; each
    untried before tried. [] when nothing is usable."""
    now = router._clock()
    tracker = router.tracker

    def out(inst: Instance) -> bool:
        # Without probes an ejection simply ends with its cooldown.
        return inst.ejected and (probing or now < inst.ejected_until)

    usable = [i for i in pool.instances if i.usable()]
    fresh = [i for i in usable if not out(i)]
    if partner is not None:
        paired = [i for i in fresh if not tracker.pair_ejected(partner, i)]
    elif partners is not None:
        others = [d for d in partners.instances if d.usable() and not out(d)]
        paired = [
            i for i in fresh if any(not tracker.pair_ejected(i, d) for d in others)
        ]
    else:
        paired = fresh
    for tier in (paired, fresh, usable):
        untried = [i for i in tier if i not in avoid]
        if untried:
            return untried
        if tier:
            return tier
    return []


class Scene:
    """A router over two pools; repr'd as the states it was built from."""

    def __init__(
        self,
        router: Router,
        prefills: Pool,
        decodes: Pool,
        avoid: frozenset[Instance],
        probing: bool,
        story: str,
    ) -> None:
        self.router, self.prefills, self.decodes = router, prefills, decodes
        self.avoid, self.probing, self.story = avoid, probing, story

    def __repr__(self) -> str:
        return self.story


@st.composite
def scenes(draw: st.DrawFn) -> Scene:
    """Two pools of instances in any state, with some pairs ejected."""
    clock = Clock()
    policy = draw(st.sampled_from(["round_robin", "least_inflight", "power_of_two"]))
    prefill_shapes = draw(st.lists(shapes, min_size=1, max_size=4))
    decode_shapes = draw(st.lists(shapes, min_size=1, max_size=4))
    prefills = [instance("prefill") for _ in prefill_shapes]
    decodes = [instance("decode") for _ in decode_shapes]
    # Pairs are ejected by their failures, before the instances take their
    # states (the tracker records no failure with an ejected one).
    tracker = IntegrityTracker(
        EjectionConfig(instance_failures=1000, pair_failures=1, cooldown_s=30), clock
    )
    all_pairs = [(p, d) for p in prefills for d in decodes]
    for p, d in draw(st.lists(st.sampled_from(all_pairs), unique=True)):
        tracker.record_failure(p, d)
    for insts, states in ((prefills, prefill_shapes), (decodes, decode_shapes)):
        for inst, state in zip(insts, states, strict=True):
            shape(inst, state, clock.now)
    everyone = prefills + decodes
    avoid = frozenset(draw(st.lists(st.sampled_from(everyone), unique=True)))
    probing = draw(st.booleans())
    names = {
        i: f"{i.role[0]}{n}"
        for insts in (prefills, decodes)
        for n, i in enumerate(insts)
    }
    described = ", ".join(
        f"{names[i]}={s}"
        for i, s in zip(everyone, prefill_shapes + decode_shapes, strict=True)
    )
    out_pairs = [(names[p], names[d]) for p, d in tracker._pairs]
    story = (
        f"Scene({policy}, probing={probing}, {described}, ejected pairs={out_pairs}, "
        f"avoid={sorted(names[i] for i in avoid)})"
    )
    return Scene(
        Router(tracker, clock),
        Pool("prefill", policy, prefills),
        Pool("decode", policy, decodes),
        avoid,
        probing,
        story,
    )


@_ROUTING
@given(scene=scenes(), picks=st.integers(1, 3))
def test_the_router_picks_from_the_best_group_its_docstring_names(
    scene: Scene, picks: int
) -> None:
    """Never an unusable instance; an ejected one or an ejected pair only when
    no better choice exists; None only when nothing is usable."""
    router = scene.router
    for _ in range(picks):
        allowed = best_choices(
            router, scene.prefills, scene.avoid, None, scene.decodes, scene.probing
        )
        prefill = router.pick(
            scene.prefills,
            b"",
            scene.avoid,
            probing=scene.probing,
            partners=scene.decodes,
        )
        assert prefill in allowed if allowed else prefill is None
        allowed = best_choices(
            router, scene.decodes, scene.avoid, prefill, None, scene.probing
        )
        decode = router.pick(
            scene.decodes, b"", scene.avoid, partner=prefill, probing=scene.probing
        )
        assert decode in allowed if allowed else decode is None


def test_prefill_steering_sees_a_decode_back_from_cooldown_without_probes() -> None:
    """The regression Hypothesis found: the prefill's pick read the decode's
    expired ejection as still on, ignored every pair and chose the one pair
    still ejected; the decode's pick then ended the ejection and took it."""
    clock = Clock()
    tracker = IntegrityTracker(
        EjectionConfig(instance_failures=1000, pair_failures=1), clock
    )
    router = Router(tracker, clock)
    bad, good = instance("prefill"), instance("prefill")
    decode = instance("decode")
    tracker.record_failure(bad, decode)  # the pair (bad, decode) is out
    decode.ejected_until = clock.now - 1  # its cooldown is over; no probe noticed
    prefills = Pool("prefill", "round_robin", [bad, good])
    decodes = Pool("decode", "round_robin", [decode])
    for _ in range(4):
        prefill = router.pick(prefills, probing=False, partners=decodes)
        assert prefill is good


@_QUICK
@given(
    weights=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    others=st.lists(shapes, max_size=3),
    cycles=st.integers(1, 3),
)
def test_round_robin_gives_each_best_instance_its_weight_in_every_cycle(
    weights: list[int], others: list[Shape], cycles: int
) -> None:
    """Smooth weighted round robin among the fresh, usable instances; the
    others (unusable, or ejected while a fresh one exists) get nothing."""
    clock = Clock()
    router = Router(IntegrityTracker(EjectionConfig(), clock), clock)
    best = [instance("decode", float(w)) for w in weights]
    rest = [shape(instance("decode"), s, clock.now) for s in others]
    rest = [i for i in rest if not i.usable() or i.ejected_until > clock.now]
    pool = Pool("decode", "round_robin", best + rest)
    total = sum(weights)
    for _ in range(cycles):
        picks = Counter(router.pick(pool) for _ in range(total))
        assert picks == Counter(dict(zip(best, weights, strict=True)))


@_QUICK
@given(
    scene=scenes(),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=30),
)
def test_least_inflight_sends_each_request_to_a_least_loaded_best_instance(
    scene: Scene, steps: list[tuple[bool, int]]
) -> None:
    """Requests start (a pick, in_flight + 1) and finish in any order: each
    pick has the lowest in-flight per weight of its group."""
    router, pool = scene.router, scene.decodes
    pool.policy = "least_inflight"
    for start, which in steps:
        if start:
            allowed = best_choices(router, pool, frozenset(), None, None, scene.probing)
            chosen = router.pick(pool, probing=scene.probing)
            if chosen is None:
                assert not allowed
                continue
            assert chosen in allowed
            assert chosen.load() == min(i.load() for i in allowed)
            chosen.in_flight += 1
        else:
            busy = [i for i in pool.instances if i.in_flight]
            if busy:
                busy[which % len(busy)].in_flight -= 1


@_QUICK
@given(
    loads=st.lists(
        st.tuples(st.integers(0, 5), st.sampled_from([0.5, 1.0, 2.0])),
        min_size=2,
        max_size=5,
    ),
    picks=st.integers(1, 20),
)
def test_power_of_two_never_picks_the_only_most_loaded_candidate(
    loads: list[tuple[int, float]], picks: int
) -> None:
    """Two distinct candidates are compared: the busier one never wins, so a
    candidate busier than all others is never chosen."""
    cands = []
    for in_flight, weight in loads:
        inst = instance("prefill", weight)
        inst.in_flight = in_flight
        cands.append(inst)
    top = max(c.load() for c in cands)
    busiest = [c for c in cands if c.load() == top]
    for _ in range(picks):
        chosen = power_of_two(cands, b"")
        assert chosen in cands
        if len(busiest) == 1:
            assert chosen is not busiest[0]


@_QUICK
@given(loads=st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_least_inflight_ties_share_picks_evenly(loads: list[int]) -> None:
    """With loads held fixed, the tied least-loaded instances take turns."""
    cands = []
    for in_flight in loads:
        inst = instance("prefill")
        inst.in_flight = in_flight
        cands.append(inst)
    low = min(loads)
    tied = [c for c in cands if c.in_flight == low]
    picks = Counter(least_inflight(cands, b"") for _ in range(3 * len(tied)))
    assert picks == Counter({c: 3 for c in tied})
