"""Cost of KV checksums in the fake engine: P/D time to first token with
checksums on (fail-closed) vs off, in the same run.

Two fake P/D pairs run in this process (``fake_engine.testing``): one with
checksums off, one on. Per concurrency level ``c``, batches of ``c`` new
prompts go through both pairs, one pair after the other, alternating which
goes first (off-on, on-off, ...), so that load from other processes, which
comes and goes over seconds, falls on both alike. A request is a proxy's two
legs straight to the engines: the prefill (max_tokens 1) and the decode,
streamed. The garbage collector runs between batches, and the heap made by
the warm-up is frozen (``gc.freeze``, as vLLM does after startup).

Prints, as on/off ratios, the medians and p90s of prefill latency, decode
TTFT (its KV load and verification included) and their sum (the client's
TTFT behind a proxy); the median over batch pairs of each pair's on/off
ratio of P/D TTFT medians (the estimate least moved by load that changes
between batches), with its quartiles; the spread of per-round median ratios;
CPU seconds per request of the whole process (engines and client). Goal
(issue 8): P/D TTFT ratio <= 1.02 at concurrency 1 and 32.

With ``--breakdown`` a last phase per level on the checksummed pair times
every engine_patch call the engines make, per request and engine (producer,
consumer), worker and scheduler side.

    .venv/bin/python benchmarks/bench_fake_engine.py [--rounds 3]
        [--concurrency 1,32] [--requests 32] [--breakdown] [--compile]

The engines run as fast as the CPU goes (no simulated compute speed: the
fake engine's simulated step time would absorb the checksums' time), so the
ratio is the worst case: the fake model's forward is far cheaper than a real
one.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import inspect
import os
import random
import statistics
import string
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import torch

from engine_patch import checksum_kernel
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.worker import KVChecksumWorker
from fake_engine.config import Role
from fake_engine.engine import Engine
from fake_engine.testing import EngineSpec, fake_engines
from proxy.body import PREFILL_KV_PARAMS

COMPLETIONS = "/v1/completions"
METRICS = ("prefill", "decode TTFT", "P/D TTFT")
PHASES = ("off", "on")


@dataclass(frozen=True)
class Sample:
    """One P/D request's seconds: prefill, decode's first token, their sum."""

    prefill: float
    decode_ttft: float

    @property
    def values(self) -> tuple[float, float, float]:
        return (self.prefill, self.decode_ttft, self.prefill + self.decode_ttft)


@dataclass
class Batch:
    """One batch of requests through one pair: their samples, the process's
    CPU seconds and the garbage collector's seconds while it ran."""

    samples: list[Sample]
    cpu: float
    gc: float

    def median(self, index: int) -> float:
        return statistics.median(s.values[index] for s in self.samples)


@dataclass
class Phase:
    """A pair's batches at one concurrency level."""

    batches: list[Batch] = field(default_factory=list)

    def values(self, index: int) -> list[float]:
        return [s.values[index] for b in self.batches for s in b.samples]

    def per_request(self, attribute: str) -> float:
        count = sum(len(b.samples) for b in self.batches)
        return sum(getattr(b, attribute) for b in self.batches) / count


class GCTimer:
    """Seconds the garbage collector runs, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, event: str, info: dict[str, int]) -> None:
        if event == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


async def pd_request(
    session: aiohttp.ClientSession,
    prefill_url: str,
    decode_url: str,
    prompt: str,
    max_tokens: int,
) -> Sample:
    """A proxy's prefill then streamed decode; raises on any failure."""
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    async with session.post(
        prefill_url + COMPLETIONS,
        json={**body, "kv_transfer_params": PREFILL_KV_PARAMS},
    ) as response:
        answer = msgspec.json.decode(await response.read())
        if response.status != 200:
            raise RuntimeError(f"prefill: {response.status} {answer}")
    params = answer["kv_transfer_params"]
    prefilled = time.perf_counter()
    first = None
    decode = {
        **body,
        "max_tokens": max_tokens,
        "stream": True,
        "kv_transfer_params": params,
    }
    async with session.post(decode_url + COMPLETIONS, json=decode) as response:
        if response.status != 200:
            raise RuntimeError(f"decode: {response.status} {await response.text()}")
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                event = msgspec.json.decode(line[6:])
                if "error" in event:
                    raise RuntimeError(f"decode: {event['error']}")
                if event["choices"] and event["choices"][0].get("text"):
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError("decode: no token")
    return Sample(prefilled - start, first - prefilled)


async def run_batch(
    session: aiohttp.ClientSession,
    urls: tuple[str, str],
    prompts: list[str],
    max_tokens: int,
    gc_timer: GCTimer,
) -> Batch:
    """Every prompt through one pair at once, after a full collection."""
    gc.collect()
    gc_before = gc_timer.seconds
    cpu = time.process_time()
    samples = await asyncio.gather(
        *(pd_request(session, *urls, p, max_tokens) for p in prompts)
    )
    return Batch(list(samples), time.process_time() - cpu, gc_timer.seconds - gc_before)


def make_prompts(count: int, length: int, seed: int) -> list[str]:
    """Distinct prompts (one token per byte), so no prefix is shared."""
    rng = random.Random(seed)
    letters = string.ascii_letters + " "
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(count)]


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def report(concurrency: int, rounds: list[dict[str, Phase]], *, shared: bool) -> float:
    """Print the level's ratios on/off; returns the P/D TTFT median ratio."""
    phases = {p: Phase([b for r in rounds for b in r[p].batches]) for p in PHASES}
    num_pairs = len(phases["on"].batches)
    print(
        f"\nconcurrency {concurrency}: {len(rounds)} rounds x "
        f"{len(rounds[0]['on'].batches) * concurrency} requests per pair, "
        f"in {num_pairs} batch pairs of {concurrency}"
    )
    print(
        f"{'metric':<12} {'off ms':>8} {'on ms':>8} {'median on/off':>14} "
        f"{'p90 on/off':>11} {'paired [q1 median q3]':>23}   per-round median ratios"
    )
    ratio = 0.0
    for index, name in enumerate(METRICS):
        off, on = (statistics.median(phases[p].values(index)) for p in PHASES)
        pairs = [
            b_on.median(index) / b_off.median(index)
            for b_off, b_on in zip(
                phases["off"].batches, phases["on"].batches, strict=True
            )
        ]
        per_round = [
            statistics.median(r["on"].values(index))
            / statistics.median(r["off"].values(index))
            for r in rounds
        ]
        q1, q2, q3 = quartiles(pairs)
        p90_ratio = p90(phases["on"].values(index)) / p90(phases["off"].values(index))
        print(
            f"{name:<12} {1e3 * off:>8.2f} {1e3 * on:>8.2f} {on / off:>14.3f} "
            f"{p90_ratio:>11.3f} {q1:>7.3f} {q2:>7.3f} {q3:>7.3f}   "
            + " ".join(f"{r:.3f}" for r in per_round)
        )
        ratio = on / off
    for what, attribute in (("CPU/request", "cpu"), ("GC/request", "gc")):
        off, on = (1e3 * phases[p].per_request(attribute) for p in PHASES)
        print(
            f"{what:<12} {off:>8.2f} {on:>8.2f} "
            f"{on / off if off else float('nan'):>14.3f}"
        )
    if shared:
        print("(machine shared with other work: compare ratios, not ms)")
    return ratio


class CallTimes:
    """CPU seconds of the calling thread in engine_patch's checksum calls,
    per engine and method (CPU, not wall time: a thread preempted by other
    processes is not charged for it)."""

    def __init__(self, owners: dict[int, str]) -> None:
        # id() of each KVChecksumWorker and KVChecksumScheduler -> its engine.
        self.owners = owners
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    @classmethod
    def of(cls, engines: dict[str, Engine]) -> CallTimes:
        owners = {}
        for name, engine in engines.items():
            owners[id(engine.checksums)] = name
            for worker in engine.workers:
                owners[id(worker.checksums)] = name
        return cls(owners)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Time every public method of the worker and the scheduler."""
        patched = []
        for cls in (KVChecksumWorker, KVChecksumScheduler):
            for name, method in vars(cls).items():
                if name.startswith("_") or not inspect.isfunction(method):
                    continue
                setattr(cls, name, self._timed(f"{cls.__name__}.{name}", method))
                patched.append((cls, name, method))
        try:
            yield
        finally:
            for cls, name, method in patched:
                setattr(cls, name, method)

    def _timed(self, key: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(this: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return method(this, *args, **kwargs)
            finally:
                where = (self.owners.get(id(this), "?"), key)
                self.seconds[where] += time.thread_time() - start
                self.calls[where] += 1

        return timed

    def print(self, requests: int, ttft: float, cpu: float) -> None:
        print(
            f"\nchecksum calls per P/D request, CPU us ({requests} requests; "
            f"shares of the median P/D TTFT on, {1e3 * ttft:.2f} ms, and of "
            f"the process's CPU per request on, {1e3 * cpu:.2f} ms):"
        )
        print(f"{'engine':<9} {'call':<45} {'calls/req':>9} {'us/req':>8}")
        for (engine, key), seconds in sorted(
            self.seconds.items(), key=lambda kv: (kv[0][0], -kv[1])
        ):
            print(
                f"{engine:<9} {key:<45} {self.calls[engine, key] / requests:>9.2f} "
                f"{1e6 * seconds / requests:>8.1f}"
            )
        totals: dict[tuple[str, str], float] = defaultdict(float)
        for (engine, key), seconds in self.seconds.items():
            side = "worker" if key.startswith("KVChecksumWorker") else "scheduler"
            totals[engine, side] += seconds / requests
        for (engine, side), seconds in sorted(totals.items()):
            print(
                f"{engine:<9} {side + ' total':<45} {'':>9} {1e6 * seconds:>8.1f}"
                f"  ({100 * seconds / ttft:.2f}% of TTFT, "
                f"{100 * seconds / cpu:.2f}% of CPU)"
            )
        total = sum(totals.values())
        print(
            f"{'both':<9} {'total':<45} {'':>9} {1e6 * total:>8.1f}"
            f"  ({100 * total / ttft:.2f}% of TTFT, {100 * total / cpu:.2f}% of CPU)"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument(
        "--requests",
        type=int,
        default=32,
        help="requests per pair and round (rounded up to whole batches; at "
        "least 4 batches)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=370)
    parser.add_argument("--max-tokens", type=int, default=4)
    # The tiny llama of the real-vLLM tests.
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: four engines share the process)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the workers' fused (torch.compile) checksum kernel; compiled in "
        "the warm-up",
    )
    parser.add_argument(
        "--quiet-machine",
        action="store_true",
        help="the machine runs nothing else (drops the shared-machine note)",
    )
    args = parser.parse_args()
    if args.compile:
        os.environ[checksum_kernel.COMPILE_ENV] = "1"
    levels = [int(c) for c in args.concurrency.split(",")]
    blocks_per_request = -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    # Both sides' blocks of every request in flight, and a producer's held ones.
    max_model_len = max(2048, args.prompt_tokens + args.max_tokens)
    # An engine also holds one request of max_model_len (plus the null block).
    num_blocks = (
        max(4 * blocks_per_request * max(levels), -(-max_model_len // args.block_size))
        + 1
    )
    shape = dict(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        tp_size=args.tp,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(8192, args.prompt_tokens),
    )
    specs = [
        EngineSpec(role=role, kv_checksums=on, fail_closed=on, **shape)  # type: ignore[arg-type]
        for on in (False, True)
        for role in (Role.PRODUCER, Role.CONSUMER)
    ]
    gc_timer = GCTimer()
    gc.callbacks.append(gc_timer)
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        fake_engines(*specs) as urls,
        aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
    ):
        # After fake_engines, which sets one thread while its engines run.
        torch.set_num_threads(args.threads)
        pairs = {"off": (urls[0], urls[1]), "on": (urls[2], urls[3])}
        print(
            f"fake engines: {args.layers} layers, {args.kv_heads} KV heads x "
            f"{args.head_size}, {args.dtype}, block {args.block_size}, TP {args.tp}; "
            f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens decoded; "
            f"checksums on = fail-closed, {'compiled' if args.compile else 'eager'}; "
            f"torch threads {args.threads}"
        )
        # Warm-up at every level: first-use allocations (and compiles) and
        # connections, out of the measured batches.
        for concurrency in levels:
            for pair in pairs.values():
                prompts = make_prompts(max(4, concurrency), args.prompt_tokens, 99)
                await run_batch(session, pair, prompts, 2, gc_timer)
        # What vLLM does after startup: the objects made so far (torch,
        # aiohttp, the engines) are never scanned again, so a full collection
        # inside a batch takes as long in either phase, and not hundreds of ms.
        gc.collect()
        gc.freeze()
        seed = 0
        for concurrency in levels:
            batches = max(4, -(-args.requests // concurrency))
            rounds = []
            for _ in range(args.rounds):
                results = {p: Phase() for p in PHASES}
                for index in range(batches):
                    seed += 1
                    prompts = make_prompts(concurrency, args.prompt_tokens, seed)
                    order = PHASES if index % 2 == 0 else PHASES[::-1]
                    for phase in order:
                        results[phase].batches.append(
                            await run_batch(
                                session,
                                pairs[phase],
                                prompts,
                                args.max_tokens,
                                gc_timer,
                            )
                        )
                rounds.append(results)
            report(concurrency, rounds, shared=not args.quiet_machine)
            if args.breakdown:
                on_ttft = statistics.median(
                    s.values[2]
                    for r in rounds
                    for b in r["on"].batches
                    for s in b.samples
                )
                times = CallTimes.of(
                    {"producer": urls.engine(2), "consumer": urls.engine(3)}
                )
                count = 0
                with times.installed():
                    for _ in range(batches):
                        seed += 1
                        prompts = make_prompts(concurrency, args.prompt_tokens, seed)
                        await run_batch(
                            session, pairs["on"], prompts, args.max_tokens, gc_timer
                        )
                        count += concurrency
                on_cpu = Phase(
                    [b for r in rounds for b in r["on"].batches]
                ).per_request("cpu")
                times.print(count, on_ttft, on_cpu)


if __name__ == "__main__":
    asyncio.run(main())
