"""Cost of KVGuard's checksums in real vLLM 0.32 (CPU, tiny model): P/D
latency with checksums on vs off, in the same run, and the rate at which
the workers checksum the real KV tensors.

Phases (each starts a fresh producer and consumer; two instances at most):
``off``: plain NixlConnector on both; ``on``: KVGuardConnector (fail-closed)
around it; ``on-compiled``: the same with the fused (torch.compile) checksum.
Per phase, after warm-up requests, ``--requests`` P/D requests one at a time
straight to the engines: the prefill's latency (max_tokens 1), the decode's
time to first token (streamed, its KV load and verification included) and
its total time. Prints medians, on/off ratios, startup times and checksum
throughput (``kvguard_kv_checksum_bytes_total`` / ``..._seconds_total``).

    .venv-vllm/bin/python benchmarks/bench_vllm_pd.py [--requests 20]
        [--rounds 1] [--phases off,on] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

from vllm_servers import (
    MODEL_DIR,
    STARTUPS,
    WORK_DIR,
    EngineSpec,
    Pair,
    VllmServer,
    complete,
    ensure_model,
    metrics,
    prompts,
)

DECODE_TOKENS = 16


def phase_specs(phase: str) -> tuple[EngineSpec, EngineSpec]:
    if phase == "off":
        return EngineSpec("producer", "nixl"), EngineSpec("consumer", "nixl")
    if phase == "on":
        return EngineSpec("producer"), EngineSpec("consumer")
    if phase == "on-compiled":
        return (
            EngineSpec("producer", compile=True),
            EngineSpec("consumer", compile=True),
        )
    raise SystemExit(f"unknown phase {phase}")


async def pd_request(
    http: aiohttp.ClientSession, pair: Pair, prompt: str, request_id: str
) -> dict[str, float]:
    """One P/D request; its prefill, decode-TTFT and decode times."""
    start = time.perf_counter()
    status, answer = await complete(
        http,
        pair.producer.url,
        prompt,
        max_tokens=1,
        request_id=request_id,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    prefill_s = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"prefill failed: {answer}")
    body = {
        "model": str(MODEL_DIR),
        "prompt": prompt,
        "max_tokens": DECODE_TOKENS,
        "temperature": 0,
        "stream": True,
        "kv_transfer_params": answer["kv_transfer_params"],
    }
    start = time.perf_counter()
    first = None
    async with http.post(
        f"{pair.consumer.url}/v1/completions",
        json=body,
        headers={"X-Request-Id": request_id},
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"decode failed: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data:") and b'"text"' in line and first is None:
                first = time.perf_counter() - start
            if b'"error"' in line:
                raise RuntimeError(f"decode failed: {line!r}")
    total = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_ttft_s": first or total, "decode_s": total}


async def run_phase(
    http: aiohttp.ClientSession,
    pair: Pair,
    phase: str,
    texts: list[str],
    warmup: int,
) -> dict[str, Any]:
    producer, consumer = phase_specs(phase)
    await pair.use(producer, consumer)
    for i, prompt in enumerate(texts[:warmup]):
        await pd_request(http, pair, prompt, f"{phase}-warm-{i}")
    before = {
        "producer": await metrics(http, pair.producer.url),
        "consumer": await metrics(http, pair.consumer.url),
    }
    samples = [
        await pd_request(http, pair, prompt, f"{phase}-{i}-{time.time_ns()}")
        for i, prompt in enumerate(texts[warmup:])
    ]
    result: dict[str, Any] = {
        key: statistics.median(s[key] for s in samples) for key in samples[0]
    }
    for side in ("producer", "consumer"):
        after = await metrics(http, getattr(pair, side).url)
        done = {k: after.get(k, 0.0) - before[side].get(k, 0.0) for k in after}
        nbytes = done.get("kvguard_kv_checksum_bytes_total", 0.0)
        seconds = done.get("kvguard_kv_checksum_seconds_total", 0.0)
        if seconds > 0:
            result[f"{side}_checksum_bytes"] = nbytes
            result[f"{side}_checksum_s"] = seconds
            result[f"{side}_checksum_MBps"] = nbytes / seconds / 1e6
            result[f"{side}_checksum_ms_per_request"] = seconds / len(samples) * 1e3
        scheduler_s = done.get("kvguard_kv_checksum_scheduler_seconds_total", 0.0)
        if scheduler_s:
            result[f"{side}_scheduler_ms_per_request"] = (
                scheduler_s / len(samples) * 1e3
            )
        if side == "consumer" and phase != "off":
            result["verified"] = done.get("kvguard_kv_checksum_verified_total", 0.0)
            held = done.get("kvguard_kv_loads_held_total", 0.0)
            if held:
                result["consumer_hold_ms_per_load"] = (
                    done.get("kvguard_kv_load_hold_seconds_total", 0.0) / held * 1e3
                )
    return result


async def prefill_ab(http: aiohttp.ClientSession, texts: list[str]) -> dict[str, Any]:
    """Two producers at once, plain and KVGuard, prefills alternating between
    them: the prefill's overhead with the machine's load the same for both."""
    logs = WORK_DIR / "logs"
    servers = {
        "off": VllmServer("ab-off", 0, logs / "ab-off.log", core=0),
        "on": VllmServer("ab-on", 0, logs / "ab-on.log", core=1),
    }
    specs = {"off": EngineSpec("producer", "nixl"), "on": EngineSpec("producer")}
    try:
        for name, server in servers.items():
            server.start(specs[name])
        await asyncio.gather(*(s.wait_ready(http) for s in servers.values()))
        times: dict[str, list[float]] = {"off": [], "on": []}
        for i, prompt in enumerate(texts):
            for name in ("off", "on") if i % 2 else ("on", "off"):
                start = time.perf_counter()
                status, answer = await complete(
                    http,
                    servers[name].url,
                    prompt,
                    max_tokens=1,
                    request_id=f"ab-{name}-{i}-{time.time_ns()}",
                    kv_transfer_params={"do_remote_decode": True},
                )
                if status != 200:
                    raise RuntimeError(f"prefill failed: {answer}")
                times[name].append(time.perf_counter() - start)
        off, on = (statistics.median(times[k]) for k in ("off", "on"))
        return {"prefill_off_s": off, "prefill_on_s": on, "ratio": on / off}
    finally:
        for server in servers.values():
            server.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--phases", default="off,on")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--prefill-ab",
        action="store_true",
        help="only the interleaved prefill comparison (two producers at once)",
    )
    args = parser.parse_args()
    ensure_model()
    # Long prompts (about 12 blocks of 32 tokens): the KV a load moves.
    texts = prompts(args.warmup + args.requests, seed=7, words=(170, 180))
    results: dict[str, list[dict[str, Any]]] = {}
    connector = aiohttp.TCPConnector(force_close=True)
    if args.prefill_ab:
        async with aiohttp.ClientSession(connector=connector) as http:
            print(json.dumps(await prefill_ab(http, texts), indent=2))
        return
    async with aiohttp.ClientSession(connector=connector) as http:
        pair = Pair.create(http)
        try:
            for _ in range(args.rounds):
                for phase in args.phases.split(","):
                    result = await run_phase(http, pair, phase, texts, args.warmup)
                    results.setdefault(phase, []).append(result)
                    print(phase, json.dumps(result), flush=True)
        finally:
            pair.stop()
    summary: dict[str, Any] = {
        phase: {
            key: statistics.median(r[key] for r in runs)
            for key in runs[0]
            if all(key in r for r in runs)
        }
        for phase, runs in results.items()
    }
    if "off" in summary:
        for phase, values in summary.items():
            if phase == "off":
                continue
            for key in ("prefill_s", "decode_ttft_s", "decode_s"):
                values[f"{key}_ratio_vs_off"] = values[key] / summary["off"][key]
    summary["startup_s"] = [[name, round(seconds, 1)] for name, seconds in STARTUPS]
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
