"""Choosing the instances of one attempt.

Preference, best first: usable, not ejected, pair not ejected; then
ignoring the pair; then ejected ones (a pool whose every instance is ejected
keeps serving: checksums still guard each load). Within each, one this
request has not tried yet comes before a tried one. Unhealthy, drained or
removed instances are never chosen.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from proxy.ejection import IntegrityTracker
from proxy.instances import Instance, Pool
from proxy.policy import POLICIES


class Router:
    """Applies each pool's policy to the instances an attempt may use."""

    def __init__(
        self, tracker: IntegrityTracker, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tracker = tracker
        self._clock = clock

    def _reinstate_expired(self, inst: Instance, now: float, probing: bool) -> None:
        # Without active probes an ejection simply ends with its cooldown.
        if not probing and inst.ejected and now >= inst.ejected_until:
            inst.ejected_until = 0.0

    def pick(
        self,
        pool: Pool,
        key: bytes = b"",
        avoid: set[Instance] | frozenset[Instance] = frozenset(),
        partner: Instance | None = None,
        probing: bool = True,
        partners: Pool | None = None,
    ) -> Instance | None:
        """One instance of ``pool``, or None when none is usable.

        ``partner`` is the attempt's prefill when picking its decode, so that
        ejected pairs are avoided; ``partners`` is the decode pool when
        picking a prefill, so that a prefill whose every pair is ejected is
        avoided too.
        """
        instances = pool.instances
        if len(instances) == 1:  # every tier below comes down to this one
            inst = instances[0]
            if not inst.usable():
                return None
            if inst.ejected and not probing:
                self._reinstate_expired(inst, self._clock(), probing)
            return inst
        now = self._clock()
        usable = []
        for inst in instances:
            if inst.usable():
                self._reinstate_expired(inst, now, probing)
                usable.append(inst)
        if not usable:
            return None
        choose = POLICIES[pool.policy]
        fresh = [i for i in usable if not i.ejected]
        paired = fresh
        if fresh and self.tracker.has_ejected_pairs():
            if partner is not None:
                paired = [i for i in fresh if not self.tracker.pair_ejected(partner, i)]
            elif partners is not None:
                others = []
                for d in partners.instances:
                    if d.usable():
                        # As the decode's own pick will: its cooldown may be over.
                        self._reinstate_expired(d, now, probing)
                        if not d.ejected:
                            others.append(d)
                paired = [
                    i
                    for i in fresh
                    if any(not self.tracker.pair_ejected(i, d) for d in others)
                ]
        for tier in (paired, fresh, usable):
            if avoid:
                untried = [i for i in tier if i not in avoid]
                if untried:
                    return choose(untried, key)
            if tier:
                return choose(tier, key)
        return None  # unreachable: ``usable`` is non-empty
