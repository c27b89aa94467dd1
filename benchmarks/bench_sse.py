"""Cost of reading a large SSE event in the proxy, against a baseline.

A decode's first chunk can be megabytes (prompt logprobs, token ids of a
long prompt), and aiohttp hands it over in reads of about 64 KiB. The proxy
reads it with ``proxy.sse``: ``FirstEventScanner`` before the first output
(every stream), ``EventReader`` when it assembles a stream into one reply.
Both run on the event loop, so their time is time no other client is
served.

Each event of N MiB is fed in 64 KiB reads to this tree's classes and to
the same classes at git revision ``--baseline`` (default: the last one that
scanned the whole buffer again on each read), in the same run, alternating.
Prints the median seconds per event and this tree's time as a ratio of the
baseline's; then the same for the common case, streams of small events
(16 tokens each, one event cut across two reads).

    .venv/bin/python benchmarks/bench_sse.py [--baseline REV] [--sizes 1,4,16]
        [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable

from git_baseline import source_at

from proxy import sse

BASELINE_REV = "449ae14"
READ = 64 * 1024


def load_baseline(rev: str) -> types.ModuleType | None:
    """``proxy.sse`` as of git revision ``rev``, or None outside a git
    checkout that has it."""
    text = source_at(rev, "proxy/sse.py")
    if text is None:
        return None
    module = types.ModuleType("kvguard_baseline_sse")
    # Its dataclasses resolve their annotations through sys.modules.
    sys.modules[module.__name__] = module
    exec(compile(text, f"{rev}:proxy/sse.py", "exec"), module.__dict__)
    return module


def event_of(mib: int) -> bytes:
    """One completions data event of ``mib`` MiB."""
    text = b"x" * (mib << 20)
    return b'data: {"choices": [{"index": 0, "text": "' + text + b'"}]}\n\n'


def feed_seconds(feed: Callable[[bytes], object], event: bytes) -> float:
    """Seconds to ``feed`` a reader ``event`` in reads of ``READ`` bytes."""
    start = time.perf_counter()
    for i in range(0, len(event), READ):
        feed(event[i : i + READ])
    return time.perf_counter() - start


# A decode's event of 16 tokens, as vLLM streams a non-streamed request's.
SMALL = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 '
    b'w13 w14 w15 w16","logprobs":null,"finish_reason":null}]}\n\n'
)


def small_seconds(cls: type, streams: int = 2000) -> float:
    """Seconds per stream of three small events in four reads (one event
    cut in two), each stream a new reader."""
    reads = (SMALL, SMALL, SMALL[:50], SMALL[50:])
    start = time.perf_counter()
    for _ in range(streams):
        reader = cls()
        for read in reads:
            reader.feed(read)
    return (time.perf_counter() - start) / streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE_REV, help="git revision")
    parser.add_argument("--sizes", default="1,4,16", help="event sizes, MiB")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    baseline = load_baseline(args.baseline)
    if baseline is None:
        sys.exit(f"baseline {args.baseline} not found (not a git checkout?)")
    print(f"one event fed in {READ // 1024} KiB reads; median of {args.reps}")
    print(f"{'class':>18} {'MiB':>4} {'this s':>9} {'baseline s':>11} {'ratio':>7}")
    for name in ("FirstEventScanner", "EventReader"):
        for mib in (int(size) for size in args.sizes.split(",")):
            event = event_of(mib)
            times: dict[str, list[float]] = {"this": [], "baseline": []}
            for _ in range(args.reps):
                for label, module in (("this", sse), ("baseline", baseline)):
                    times[label].append(
                        feed_seconds(getattr(module, name)().feed, event)
                    )
            this, base = (statistics.median(times[k]) for k in ("this", "baseline"))
            print(f"{name:>18} {mib:>4} {this:>9.4f} {base:>11.4f} {this / base:>7.3f}")
    print("\nstreams of three small events in four reads, us per stream")
    for name in ("FirstEventScanner", "EventReader"):
        times = {"this": [], "baseline": []}
        for _ in range(max(args.reps, 5)):
            for label, module in (("this", sse), ("baseline", baseline)):
                times[label].append(small_seconds(getattr(module, name)))
        this, base = (statistics.median(times[k]) for k in ("this", "baseline"))
        us, base_us = this * 1e6, base * 1e6
        print(f"{name:>18} {'':>4} {us:>9.2f} {base_us:>11.2f} {this / base:>7.3f}")


if __name__ == "__main__":
    main()
