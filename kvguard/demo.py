"""``kvguard demo``: watch the proxy catch corrupted KV loads, on one CPU machine.

On free 127.0.0.1 ports it starts two fake prefills (the second corrupts every
KV transfer), one fake decode that verifies checksums and fails bad loads,
a monolithic fake engine for reference answers, and the proxy in front of the
P/D trio. It sends a few dozen requests, stream and non-stream, prints what
happened, stops everything and exits 0 when every answer was right.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
import time
from typing import Any

import aiohttp
import msgspec

from proxy.config import ProxyConfig
from proxy.instances import Instance
from proxy.testing import running_proxy

PROMPTS = [
    "Explain why a prefill instance hands its KV cache to a decode instance.",
    "Write a haiku about RDMA.",
    "What does a checksum over a KV block protect against?",
    "List three ways a KV transfer can go wrong.",
    "Summarise disaggregated serving in one sentence.",
    "Why must a proxy not stream an answer before the first token?",
]


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvguard demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=48, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--verbose", action="store_true", help="show engine and proxy logs"
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="after the traffic, keep everything running and print the proxy's "
        "status page URL (Ctrl-C stops)",
    )
    return parser.parse_args(argv)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    for match in pattern.finditer(text):
        if all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as resp:
        return await resp.text()


async def _ask(
    session: aiohttp.ClientSession, url: str, prompt: str, stream: bool, max_tokens: int
) -> str | None:
    """The completion's text, or None when the request failed."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return None
        if not stream:
            return str((await resp.json())["choices"][0]["text"])
        text = []
        for event in (await resp.read()).split(b"\n\n"):
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            obj = msgspec.json.decode(event[6:])
            if "error" in obj:
                return None
            text.append(obj["choices"][0].get("text") or "")
        return "".join(text)


async def _run(args: argparse.Namespace) -> int:
    from fake_engine.config import FaultConfig, FaultKind, FaultSide, Role
    from fake_engine.testing import EngineSpec, fake_engines

    corrupting = FaultConfig(fault=FaultKind.BITFLIP, side=FaultSide.PRODUCER, rate=1.0)
    specs = (
        EngineSpec(role=Role.PRODUCER),
        EngineSpec(role=Role.PRODUCER, fault=corrupting),
        EngineSpec(role=Role.CONSUMER, fail_closed=True),
        EngineSpec(role=Role.BOTH),
    )
    print("kvguard demo: starting 2 fake prefills (one corrupts every KV transfer),")
    print("              1 fake decode, 1 monolithic reference engine and the proxy")
    async with fake_engines(*specs) as (good, bad, decode, mono):
        config = ProxyConfig.model_validate(
            {
                "models": {
                    "*": {
                        "prefill": {"instances": [{"url": good}, {"url": bad}]},
                        "decode": {"instances": [{"url": decode}]},
                    }
                },
                "retry": {"backoff_base_s": 0.002},
                "ejection": {"instance_failures": 3, "cooldown_s": 600},
                "logging": {
                    "attempts": args.verbose,
                    "level": "info" if args.verbose else "error",
                },
            }
        )
        async with running_proxy(config) as running:
            proxy = running.url
            state = running.state
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=120)
            ) as session:
                print(f"  prefills {good} (good), {bad} (corrupting)")
                print(f"  decode   {decode}    proxy {proxy}\n")
                wanted = {}
                for prompt in PROMPTS:
                    text = await _ask(session, mono, prompt, False, args.max_tokens)
                    if text is None:
                        print("the reference engine failed; giving up", file=sys.stderr)
                        return 1
                    wanted[prompt] = text
                started = time.monotonic()
                jobs: asyncio.Queue[int] = asyncio.Queue()
                for i in range(args.requests):
                    jobs.put_nowait(i)
                outcomes: list[tuple[bool, bool]] = []  # (stream, identical)

                async def client() -> None:
                    while not jobs.empty():
                        i = jobs.get_nowait()
                        prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 1
                        got = await _ask(
                            session, proxy, prompt, stream, args.max_tokens
                        )
                        outcomes.append((stream, got == wanted[prompt]))

                await asyncio.gather(*(client() for _ in range(args.concurrency)))
                elapsed = time.monotonic() - started
                await asyncio.sleep(0.2)  # background aborts land
                proxy_metrics = await _get(session, proxy + "/metrics")
                decode_metrics = await _get(session, decode + "/metrics")
                held = 0.0
                for url in (good, bad):
                    text = await _get(session, url + "/metrics")
                    held += _metric(text, "kvguard_kv_blocks_held")
            bad_inst = next(i for i in state.all_instances() if i.url == bad)
            ok = _summary(
                args,
                outcomes,
                elapsed,
                proxy_metrics,
                decode_metrics,
                held,
                bad,
                bad_inst,
            )
            if args.keep:
                await _keep_running(proxy)
    return 0 if ok else 1


async def _keep_running(proxy: str) -> None:
    """Waits for Ctrl-C or SIGTERM, the proxy and engines still serving."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"\nThe demo keeps running. Status page: {proxy}/status", flush=True)
    print(f"Send requests to {proxy}/v1/completions; Ctrl-C stops.", flush=True)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _summary(
    args: argparse.Namespace,
    outcomes: list[tuple[bool, bool]],
    elapsed: float,
    proxy_metrics: str,
    decode_metrics: str,
    held: float,
    bad: str,
    bad_inst: Instance,
) -> bool:
    """Prints what happened; True when every answer was right."""
    identical = sum(ok for _, ok in outcomes)
    streams = sum(stream for stream, _ in outcomes)
    caught = _metric(decode_metrics, "kvguard_kv_checksum_mismatch_total")
    integrity = _metric(proxy_metrics, "kvguard_proxy_kv_integrity_failures_total")
    retries = _metric(proxy_metrics, "kvguard_proxy_retries_total")
    ejected = _metric(
        proxy_metrics, "kvguard_proxy_ejections_total", instance=bad, kind="instance"
    )
    rows: list[tuple[str, Any]] = [
        (
            "requests",
            f"{len(outcomes)} ({streams} stream, {len(outcomes) - streams} "
            f"non-stream) in {elapsed:.1f}s",
        ),
        ("answers identical to a monolithic run", f"{identical} / {len(outcomes)}"),
        ("corrupted KV loads caught by the decode", f"{caught:.0f}"),
        ("integrity failures seen by the proxy", f"{integrity:.0f}"),
        ("retries", f"{retries:.0f}"),
        ("faulty prefill ejected", "yes" if bad_inst.ejected and ejected else "no"),
        ("KV blocks still held by the prefills", f"{held:.0f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("  " + "-" * (width + 28))
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("  " + "-" * (width + 28))
    ok = (
        identical == len(outcomes) == args.requests
        and caught >= 1
        and bool(ejected)
        and held == 0
    )
    if ok:
        print("\nEvery answer was right although one prefill corrupted every transfer:")
        print("the decode's checksums caught each bad load before its first token,")
        print("the proxy retried it on the good prefill and ejected the faulty one.")
    else:
        print(
            "\nThe demo did not go as expected (run with --verbose).", file=sys.stderr
        )
    sys.stdout.flush()
    return ok


def main(argv: list[str]) -> int:
    """Runs the demo; returns 0 when every answer matched the monolithic run."""
    args = _parse_args(argv)
    level = logging.INFO if args.verbose else logging.CRITICAL
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        for name in ("kvguard", "aiohttp"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_run(args))
    return uvloop.run(_run(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
