"""Cost of KV checksums in the fake engine: P/D time to first token with
checksums on (fail-closed) vs off, in the same run.

Two fake P/D pairs run in this process (``fake_engine.testing``): one with
checksums off, one on. Per concurrency level, ``--rounds`` rounds each run
both pairs over the same prompts, in alternating order; a request is a
proxy's two legs straight to the engines: the prefill (max_tokens 1) and the
decode, streamed. Prints, as on/off ratios, the medians and p90s of prefill
latency, decode TTFT (its KV load and verification included) and their sum
(the client's TTFT behind a proxy), with the spread of the per-round median
ratios. Goal (issue 8): TTFT ratio <= 1.02 at concurrency 1 and 32.

With ``--breakdown`` a last phase on the checksummed pair times every
engine_patch call the engines make (worker and scheduler side), per request.

    .venv/bin/python benchmarks/bench_fake_engine.py [--rounds 3]
        [--concurrency 1,32] [--requests 24] [--breakdown] [--compile]

The engines run as fast as the CPU goes (no simulated compute speed: the
fake engine's simulated step time would absorb the checksums' time), so the
ratio is the worst case: the fake model's forward is far cheaper than a real
one.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import os
import random
import statistics
import string
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import torch

from engine_patch import checksum_kernel
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.worker import KVChecksumWorker
from fake_engine.config import Role
from fake_engine.testing import EngineSpec, fake_engines

# What a proxy adds to the prefill's body.
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
COMPLETIONS = "/v1/completions"
METRICS = ("prefill", "decode TTFT", "P/D TTFT")


@dataclass(frozen=True)
class Sample:
    """One P/D request's seconds: prefill, decode's first token, their sum."""

    prefill: float
    decode_ttft: float

    @property
    def values(self) -> tuple[float, float, float]:
        return (self.prefill, self.decode_ttft, self.prefill + self.decode_ttft)


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
        json={**body, "kv_transfer_params": PREFILL_PARAMS},
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


async def run_phase(
    session: aiohttp.ClientSession,
    urls: tuple[str, str],
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
) -> list[Sample]:
    """Every prompt through one pair, ``concurrency`` at a time."""
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> Sample:
        async with limit:
            return await pd_request(session, *urls, prompt, max_tokens)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def make_prompts(count: int, length: int, seed: int) -> list[str]:
    """Distinct prompts (one token per byte), so no prefix is shared."""
    rng = random.Random(seed)
    letters = string.ascii_letters + " "
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(count)]


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def report(
    concurrency: int, rounds: list[dict[str, list[Sample]]], *, shared: bool
) -> None:
    """Ratios on/off of the median and p90 of each metric over all rounds,
    and the spread of per-round median ratios."""
    print(
        f"\nconcurrency {concurrency}: {len(rounds)} rounds x "
        f"{len(rounds[0]['on'])} requests per phase"
    )
    print(
        f"{'metric':<12} {'off ms':>8} {'on ms':>8} {'median on/off':>14} "
        f"{'p90 on/off':>11} {'per-round median ratios':>28}"
    )
    for index, name in enumerate(METRICS):
        values = {
            phase: [s.values[index] for r in rounds for s in r[phase]]
            for phase in ("off", "on")
        }
        per_round = [
            statistics.median(s.values[index] for s in r["on"])
            / statistics.median(s.values[index] for s in r["off"])
            for r in rounds
        ]
        off, on = (statistics.median(values[p]) for p in ("off", "on"))
        print(
            f"{name:<12} {1e3 * off:>8.2f} {1e3 * on:>8.2f} {on / off:>14.3f} "
            f"{p90(values['on']) / p90(values['off']):>11.3f} "
            f"{' '.join(f'{r:.3f}' for r in per_round):>28}"
        )
    if shared:
        print("(machine shared with other work: compare ratios, not ms)")


class CallTimes:
    """Seconds spent in engine_patch's checksum calls, per method."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

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
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        return timed

    def print(self, requests: int) -> None:
        print(f"\nchecksum calls during {requests} P/D requests (both engines):")
        print(f"{'call':<45} {'calls':>7} {'ms total':>9} {'us/request':>11}")
        for key, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            print(
                f"{key:<45} {self.calls[key]:>7} {1e3 * seconds:>9.2f} "
                f"{1e6 * seconds / requests:>11.1f}"
            )
        total = sum(self.seconds.values())
        print(
            f"{'total':<45} {'':>7} {1e3 * total:>9.2f} {1e6 * total / requests:>11.1f}"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument(
        "--requests",
        type=int,
        default=24,
        help="requests per phase (at least 2x concurrency)",
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
    torch.set_num_threads(args.threads)
    if args.compile:
        os.environ[checksum_kernel.COMPILE_ENV] = "1"
    levels = [int(c) for c in args.concurrency.split(",")]
    blocks_per_request = -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    # Both sides' blocks of every request in flight, and a producer's held ones.
    num_blocks = 4 * blocks_per_request * max(args.requests, max(levels)) + 1
    shape = dict(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        tp_size=args.tp,
        num_blocks=num_blocks,
        max_model_len=max(2048, args.prompt_tokens + args.max_tokens),
        max_num_batched_tokens=max(8192, args.prompt_tokens),
    )
    specs = [
        EngineSpec(role=role, kv_checksums=on, fail_closed=on, **shape)  # type: ignore[arg-type]
        for on in (False, True)
        for role in (Role.PRODUCER, Role.CONSUMER)
    ]
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        fake_engines(*specs) as urls,
        aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
    ):
        pairs = {"off": (urls[0], urls[1]), "on": (urls[2], urls[3])}
        print(
            f"fake engines: {args.layers} layers, {args.kv_heads} KV heads x "
            f"{args.head_size}, {args.dtype}, block {args.block_size}, TP {args.tp}; "
            f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens decoded; "
            f"checksums on = fail-closed, {'compiled' if args.compile else 'eager'}; "
            f"torch threads {args.threads}"
        )
        for pair in pairs.values():
            await run_phase(
                session, pair, make_prompts(8, args.prompt_tokens, 99), 4, 2
            )
        seed = 0
        for concurrency in levels:
            count = max(args.requests, 2 * concurrency)
            rounds = []
            for index in range(args.rounds):
                seed += 1
                prompts = make_prompts(count, args.prompt_tokens, seed)
                order = ("off", "on") if index % 2 == 0 else ("on", "off")
                results = {}
                for phase in order:
                    results[phase] = await run_phase(
                        session, pairs[phase], prompts, concurrency, args.max_tokens
                    )
                rounds.append(results)
            report(concurrency, rounds, shared=not args.quiet_machine)
        if args.breakdown:
            times = CallTimes()
            count = max(args.requests, 2 * max(levels))
            with times.installed():
                await run_phase(
                    session,
                    pairs["on"],
                    make_prompts(count, args.prompt_tokens, 1000),
                    max(levels),
                    args.max_tokens,
                )
            times.print(count)


if __name__ == "__main__":
    asyncio.run(main())
