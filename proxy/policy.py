"""Picking one instance from candidates: round_robin, least_inflight,
power_of_two and prefix_hash (weighted rendezvous hashing of the prompt's
prefix, so a prompt keeps landing where its prefix is cached).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence

from proxy.instances import Instance

Picker = Callable[[Sequence[Instance], bytes], Instance]


def round_robin(cands: Sequence[Instance], key: bytes) -> Instance:
    """Smooth weighted round robin (nginx's): even spread, weights honoured."""
    total = 0.0
    best = cands[0]
    for inst in cands:
        inst.rr_current += inst.weight
        total += inst.weight
        if inst.rr_current > best.rr_current:
            best = inst
    best.rr_current -= total
    return best


def least_inflight(cands: Sequence[Instance], key: bytes) -> Instance:
    """Fewest in-flight requests per unit of weight; ties go round robin."""
    low = min(inst.load() for inst in cands)
    tied = [inst for inst in cands if inst.load() == low]
    return tied[0] if len(tied) == 1 else round_robin(tied, key)


def power_of_two(cands: Sequence[Instance], key: bytes) -> Instance:
    """Two distinct weighted random choices, the less loaded wins."""
    if len(cands) == 1:
        return cands[0]
    weights = [c.weight for c in cands]
    (i,) = random.choices(range(len(cands)), weights=weights)
    weights[i] = 0.0  # the second is another instance
    (j,) = random.choices(range(len(cands)), weights=weights)
    a, b = cands[i], cands[j]
    return a if a.load() <= b.load() else b


def _unit(key: bytes, url: str) -> float:
    digest = hashlib.blake2b(key, digest_size=8, person=b"kvguard", salt=b"")
    digest.update(url.encode())
    value = int.from_bytes(digest.digest(), "big")
    return (value + 1) / (2**64 + 2)  # strictly inside (0, 1)


def prefix_hash(cands: Sequence[Instance], key: bytes) -> Instance:
    """Weighted rendezvous hash of the prompt prefix over the candidates' URLs.

    Removing an instance moves only its own prefixes; an empty key falls
    back to least_inflight.
    """
    if not key:
        return least_inflight(cands, key)
    return max(cands, key=lambda inst: -inst.weight / math.log(_unit(key, inst.url)))


POLICIES: dict[str, Picker] = {
    "round_robin": round_robin,
    "least_inflight": least_inflight,
    "power_of_two": power_of_two,
    "prefix_hash": prefix_hash,
}
