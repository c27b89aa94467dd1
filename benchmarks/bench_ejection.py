"""The integrity tracker's cost per clean load while failures are in its window.

Random failures on every pair (a flaky network, not one faulty instance) keep
many cases open and eject nobody; each clean load then re-judges the cases it
can change. The baseline, measured in the same run, re-judges every instance
with a failure in the window, as the tracker did before.
"""

from __future__ import annotations

import argparse
import random
import time

from proxy.config import EjectionConfig
from proxy.ejection import IntegrityTracker
from proxy.instances import Instance


class JudgingEveryone(IntegrityTracker):
    """The baseline: a clean load re-judges every side of every failed pair."""

    def _changed_by_clean(self, prefill: Instance, decode: Instance) -> set[Instance]:
        return {p for _, p, _ in self._failures} | {d for _, _, d in self._failures}


def per_success_us(
    kind: type[IntegrityTracker], size: int, args: argparse.Namespace
) -> float:
    """Microseconds per record_success after a warm-up that fills the window."""
    prefills = [Instance(f"http://10.0.0.{i}:1", "prefill", "m") for i in range(size)]
    decodes = [Instance(f"http://10.0.1.{i}:1", "decode", "m") for i in range(size)]
    now = [0.0]
    config = EjectionConfig(instance_failures=10**6, pair_failures=10**6)
    tracker = kind(config, clock=lambda: now[0])
    rng = random.Random(1)
    step = 1.0 / args.rate
    for _ in range(int(config.window_s * args.rate)):
        now[0] += step
        p, d = rng.choice(prefills), rng.choice(decodes)
        if rng.random() < args.failure_rate:
            tracker.record_failure(p, d)
        else:
            tracker.record_success(p, d)
    pairs = [(rng.choice(prefills), rng.choice(decodes)) for _ in range(args.loads)]
    started = time.perf_counter()
    for p, d in pairs:
        now[0] += step
        tracker.record_success(p, d)
    return (time.perf_counter() - started) / int(args.loads) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,8,32", help="instances per role")
    parser.add_argument("--rate", type=float, default=100.0, help="loads per second")
    parser.add_argument("--failure-rate", type=float, default=0.01)
    parser.add_argument("--loads", type=int, default=500, help="timed clean loads")
    args = parser.parse_args()
    print(
        f"bench_ejection: {args.rate:g} loads/s, {args.failure_rate:.1%} failing "
        f"at random, {args.loads} timed clean loads"
    )
    print(f"{'per role':>8} {'tracker us':>11} {'baseline us':>12} {'ratio':>7}")
    for size in (int(s) for s in args.sizes.split(",")):
        ours = per_success_us(IntegrityTracker, size, args)
        base = per_success_us(JudgingEveryone, size, args)
        print(f"{size:>8} {ours:>11.1f} {base:>12.1f} {ours / base:>7.3f}")


if __name__ == "__main__":
    main()
