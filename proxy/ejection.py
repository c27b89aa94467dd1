"""Ejecting instances and prefill–decode pairs for KV integrity failures.

A checksum mismatch is seen by the decode but may come from either side: the
producer's blocks or the consumer's load. A failure counts against an
instance only when its partner in that failure is vouched for by a clean load
with some *other* instance within the window; a faulty prefill beside a good
one is then blamed alone, and a lone decode is never ejected for its
prefill's faults. Failures of one pair count against the pair regardless.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from proxy.config import EjectionConfig
from proxy.instances import Instance


@dataclass(slots=True, frozen=True)
class Ejection:
    """An ejection decision: one instance, or a pair when ``partner`` is set."""

    instance: Instance
    partner: Instance | None
    failures: int
    until: float


class IntegrityTracker:
    """Windows of integrity failures and clean loads; decides ejections."""

    def __init__(
        self, config: EjectionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._failures: deque[tuple[float, Instance, Instance]] = deque()
        # instance -> partner -> time of the last clean load between them
        self._clean: dict[Instance, dict[Instance, float]] = {}
        self._pairs: dict[tuple[Instance, Instance], float] = {}

    def record_success(self, prefill: Instance, decode: Instance) -> list[Ejection]:
        """A decode loaded the prefill's KV and produced data."""
        now = self._clock()
        self._clean.setdefault(prefill, {})[decode] = now
        self._clean.setdefault(decode, {})[prefill] = now
        if not self._failures:
            return []
        # A new voucher may complete the case against an earlier failure's partner.
        self._prune(now)
        suspects = {p for _, p, _ in self._failures} | {d for _, _, d in self._failures}
        return [e for inst in suspects if (e := self._judge(inst, now)) is not None]

    def record_failure(self, prefill: Instance, decode: Instance) -> list[Ejection]:
        """A decode failed to load the prefill's KV (checksum mismatch)."""
        now = self._clock()
        self._failures.append((now, prefill, decode))
        self._prune(now)
        if not self.config.enabled:
            return []
        out: list[Ejection] = []
        pair = (prefill, decode)
        count = sum(1 for _, p, d in self._failures if p is prefill and d is decode)
        if count >= self.config.pair_failures and not self.pair_ejected(
            prefill, decode
        ):
            until = now + self.config.cooldown_s
            self._pairs[pair] = until
            out.append(Ejection(prefill, decode, count, until))
        for inst in (prefill, decode):
            ejection = self._judge(inst, now)
            if ejection is not None:
                out.append(ejection)
        return out

    def has_ejected_pairs(self) -> bool:
        """Cheap check that lets routing skip pair lookups in the common case."""
        return bool(self._pairs)

    def pair_ejected(self, prefill: Instance, decode: Instance) -> bool:
        until = self._pairs.get((prefill, decode))
        if until is None:
            return False
        if self._clock() >= until:
            del self._pairs[(prefill, decode)]
            return False
        return True

    def blamed(self, inst: Instance) -> int:
        """Failures in the window that count against ``inst``."""
        now = self._clock()
        self._prune(now)
        return self._blamed(inst, now)

    def forget(self, inst: Instance) -> None:
        """Drops an instance's records (it was ejected or removed)."""
        self._failures = deque(
            f for f in self._failures if inst is not f[1] and inst is not f[2]
        )
        self._clean.pop(inst, None)
        for partners in self._clean.values():
            partners.pop(inst, None)
        for pair in [p for p in self._pairs if inst in p]:
            del self._pairs[pair]

    def _prune(self, now: float) -> None:
        horizon = now - self.config.window_s
        while self._failures and self._failures[0][0] < horizon:
            self._failures.popleft()

    def _vouched(self, inst: Instance, besides: Instance, now: float) -> bool:
        """``inst`` loaded cleanly with an instance other than ``besides`` lately."""
        horizon = now - self.config.window_s
        partners = self._clean.get(inst)
        if not partners:
            return False
        return any(
            t >= horizon for other, t in partners.items() if other is not besides
        )

    def _blamed(self, inst: Instance, now: float) -> int:
        count = 0
        for _, p, d in self._failures:
            partner = d if p is inst else p if d is inst else None
            if partner is not None and self._vouched(partner, inst, now):
                count += 1
        return count

    def _judge(self, inst: Instance, now: float) -> Ejection | None:
        if not self.config.enabled or inst.ejected or inst.removed:
            return None
        count = self._blamed(inst, now)
        if count < self.config.instance_failures:
            return None
        until = now + self.config.cooldown_s
        inst.ejected_until = until
        inst.ejections += 1
        # Back from cooldown it starts with a clean slate.
        self._failures = deque(
            f for f in self._failures if inst is not f[1] and inst is not f[2]
        )
        return Ejection(inst, None, count, until)
