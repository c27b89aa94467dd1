"""Ejecting instances and prefill–decode pairs for KV integrity failures.

A checksum mismatch is seen by the decode but may come from either side: the
producer's blocks or the consumer's load. Blame follows the pattern across
partners within the window. For the failures of a pair (p, d):

- d is *cleared* when its loads with its other prefills are clean enough
  that the pair's failures could hardly have fallen on this pair by chance,
  were d failing alike everywhere: the hypergeometric upper tail of the
  pair's share of d's failures is below 0.2% (a faulty prefill beside good
  ones);
- the fault *follows* d when d also fails with its other prefills, at least
  twice, and is not cleared (a faulty decode fails with every prefill, even
  when it is the only decode);

and symmetrically for p. The pair's failures count against p when the fault
follows p or d is cleared, against d when it follows d or p is cleared. A
lone pair is never blamed on either side; its failures count against the
pair, unless one of its instances is ejected anyway. A failure with an
ejected instance (still serving where its pool has no other) is evidence
against nobody.
"""

from __future__ import annotations

import math
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


# An instance's other pairs say something about it only with this many
# failures seen there (for the fault to follow it) ...
_EVIDENCE = 2
# ... or when the pair's failures are this unlikely to fall on the pair by
# chance, were the instance failing alike everywhere (to clear it).
_ALPHA = 0.002


def _concentrated(failed: int, loads: int, failed_all: int, loads_all: int) -> float:
    """P(a pair with ``loads`` of ``loads_all`` loads draws ``failed`` or more
    of ``failed_all`` failures) by chance: the hypergeometric upper tail."""
    if failed <= 0:
        return 1.0
    top = min(loads, failed_all)
    # Below loads - (loads_all - failed_all) failures no draw is possible.
    first = max(failed, loads - (loads_all - failed_all))
    if first > top:
        return 0.0
    term = math.exp(
        _log_comb(failed_all, first)
        + _log_comb(loads_all - failed_all, loads - first)
        - _log_comb(loads_all, loads)
    )
    tail = term
    # Each next term from the last: C(K, x+1) C(N-K, n-x-1) / C(K, x) C(N-K, n-x).
    for x in range(first, top):
        term *= (failed_all - x) * (loads - x)
        term /= (x + 1) * (loads_all - failed_all - loads + x + 1)
        tail += term
        if term < tail * 1e-9:  # past the mode: the rest is noise
            break
    return tail


def _log_comb(n: int, k: int) -> float:
    if k < 0 or k > n:
        return -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


class _Recent:
    """Events within the last window, counted in two window-wide buckets.

    Every counter shares one grid of buckets, so counts of one instance's
    pairs add up. The estimate weighs the previous bucket by how much of it
    is still inside the window.
    """

    __slots__ = ("_bucket", "_current", "_previous")

    def __init__(self) -> None:
        self._bucket = 0
        self._current = 0
        self._previous = 0

    def add(self, now: float, width: float) -> None:
        self._roll(int(now // width))
        self._current += 1

    def count(self, now: float, width: float) -> float:
        bucket = int(now // width)
        self._roll(bucket)
        return self._current + self._previous * (1.0 - (now / width - bucket))

    def _roll(self, bucket: int) -> None:
        if bucket != self._bucket:
            self._previous = self._current if bucket == self._bucket + 1 else 0
            self._current = 0
            self._bucket = bucket


class IntegrityTracker:
    """Windows of integrity failures and clean loads; decides ejections."""

    def __init__(
        self, config: EjectionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._failures: deque[tuple[float, Instance, Instance]] = deque()
        # instance -> partner -> failures of that pair in the window (both ways)
        self._failed: dict[Instance, dict[Instance, int]] = {}
        # instance -> partner -> clean loads of that pair (one counter, both ways)
        self._clean: dict[Instance, dict[Instance, _Recent]] = {}
        self._pairs: dict[tuple[Instance, Instance], float] = {}

    def record_success(self, prefill: Instance, decode: Instance) -> list[Ejection]:
        """A decode loaded the prefill's KV and produced data."""
        if prefill.removed or decode.removed:
            return []  # finished after its instance left: nothing to keep
        now = self._clock()
        counter = self._clean.setdefault(prefill, {}).get(decode)
        if counter is None:
            counter = _Recent()
            self._clean[prefill][decode] = counter
            self._clean.setdefault(decode, {})[prefill] = counter
        counter.add(now, self.config.window_s)
        if not self._failures:
            return []
        # A clean load may complete the case against an earlier failure's side.
        self._prune(now)
        suspects = self._changed_by_clean(prefill, decode)
        return [e for inst in suspects if (e := self._judge(inst, now)) is not None]

    def _changed_by_clean(self, prefill: Instance, decode: Instance) -> set[Instance]:
        """The instances whose case a clean load of the pair can change.

        The load changes the clean counts of its two instances only, which
        weigh in the cases of their failed pairs: the two, and their failed
        partners.
        """
        suspects = {prefill, decode}
        suspects.update(self._failed.get(prefill, ()))
        suspects.update(self._failed.get(decode, ()))
        return suspects

    def record_failure(self, prefill: Instance, decode: Instance) -> list[Ejection]:
        """A decode failed to load the prefill's KV (checksum mismatch).

        A failure with an ejected instance (still in use when its pool has
        nothing else) is explained already: it is evidence against nobody.
        One with a removed instance (a request that outlived it) is dropped:
        nothing would ever forget it.
        """
        if prefill.ejected or decode.ejected or prefill.removed or decode.removed:
            return []
        now = self._clock()
        self._failures.append((now, prefill, decode))
        self._count(prefill, decode, 1)
        self._prune(now)
        if not self.config.enabled:
            return []
        count = self._failed.get(prefill, {}).get(decode, 0)
        out: list[Ejection] = []
        # The others' cases change too: this failure is evidence about them.
        suspects = {p for _, p, _ in self._failures} | {d for _, _, d in self._failures}
        for inst in (prefill, decode, *(suspects - {prefill, decode})):
            ejection = self._judge(inst, now)
            if ejection is not None:
                out.append(ejection)
        # A pair one of whose instances is out needs no ejection of its own.
        if (
            count >= self.config.pair_failures
            and not (prefill.ejected or decode.ejected)
            and not self.pair_ejected(prefill, decode)
        ):
            until = now + self.config.cooldown_s
            self._pairs[(prefill, decode)] = until
            out.append(Ejection(prefill, decode, count, until))
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
        """Drops an instance's records (it was removed)."""
        self._drop_failures(inst)
        for partner in self._clean.pop(inst, {}):
            self._clean.get(partner, {}).pop(inst, None)
        for pair in [p for p in self._pairs if inst in p]:
            del self._pairs[pair]

    def _count(self, prefill: Instance, decode: Instance, delta: int) -> None:
        for a, b in ((prefill, decode), (decode, prefill)):
            partners = self._failed.setdefault(a, {})
            left = partners.get(b, 0) + delta
            if left > 0:
                partners[b] = left
            else:
                partners.pop(b, None)
                if not partners:
                    del self._failed[a]

    def _drop_failures(self, inst: Instance) -> None:
        kept = deque(f for f in self._failures if inst is not f[1] and inst is not f[2])
        for _, p, d in self._failures:
            if p is inst or d is inst:
                self._count(p, d, -1)
        self._failures = kept

    def _prune(self, now: float) -> None:
        horizon = now - self.config.window_s
        while self._failures and self._failures[0][0] < horizon:
            _, p, d = self._failures.popleft()
            self._count(p, d, -1)

    def _with_others(
        self, inst: Instance, besides: Instance, now: float
    ) -> tuple[int, float]:
        """(failures, clean loads) of ``inst`` with partners other than ``besides``."""
        failed = sum(
            n for other, n in self._failed.get(inst, {}).items() if other is not besides
        )
        width = self.config.window_s
        clean = sum(
            c.count(now, width)
            for other, c in self._clean.get(inst, {}).items()
            if other is not besides
        )
        return failed, clean

    def _blame(
        self, prefill: Instance, decode: Instance, failed: int, now: float
    ) -> tuple[bool, bool]:
        """Whether the ``failed`` failures of (prefill, decode) count against
        (the prefill, the decode); see the module's docstring."""
        pair_clean = self._clean.get(prefill, {}).get(decode)
        clean = (
            0
            if pair_clean is None
            else round(pair_clean.count(now, self.config.window_s))
        )
        loads = failed + clean

        def verdict(f: int, c: float) -> tuple[bool, bool]:
            """(the fault follows the instance, the instance is cleared)."""
            others = f + round(c)
            if others == 0:
                return False, False
            chance = _concentrated(failed, loads, failed + f, loads + others)
            cleared = chance < _ALPHA
            return f >= _EVIDENCE and not cleared, cleared

        p_follows, p_cleared = verdict(*self._with_others(prefill, decode, now))
        d_follows, d_cleared = verdict(*self._with_others(decode, prefill, now))
        return p_follows or d_cleared, d_follows or p_cleared

    def _blamed(self, inst: Instance, now: float) -> int:
        count = 0
        for partner, failed in self._failed.get(inst, {}).items():
            if inst.role == "prefill":
                against, _ = self._blame(inst, partner, failed, now)
            else:
                _, against = self._blame(partner, inst, failed, now)
            if against:
                count += failed
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
        self._drop_failures(inst)
        return Ejection(inst, None, count, until)
