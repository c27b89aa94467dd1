"""Every kind of fault at once, under mixed clients: the proxy's whole promise.

Three prefills and three decodes each fail some transfers their own way
(bit flips, stale blocks and slow serving on the prefills; zeroed blocks,
hung loads and shifted blocks on the decodes), while clients send
completions and chat, streamed or not, and some leave early. No client may
get text built on bad KV, and once the load is over no engine may still
hold KV or run a request for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from typing import Any

import aiohttp
import pytest
from proxy_helpers import body, make_config, read_sse, text_of

pytest.importorskip("torch")

from fake_engine.config import FaultConfig, FaultKind, FaultSide, Role
from fake_engine.testing import EngineSpec, fake_engines
from proxy.testing import running_proxy
from tests.support.metrics import fetch_metric, metric

ROUTES = ("/v1/completions", "/v1/chat/completions")
# Prompts of 2 to 20 blocks (16 tokens each).
PROMPTS = [
    f"Request {i}: about block {i * 7} of the cache " + "kv " * (i * 12)
    for i in range(20)
]
REQUESTS, CONCURRENCY = 240, 12
# Attempts enough that a request exhausts them only when every pair it tries
# fails it (then it is answered 503, which is allowed, at most this often).
MAX_ATTEMPTS, MAX_UNSERVED = 6, 3


def _fault(kind: FaultKind, side: FaultSide, rate: float) -> FaultConfig:
    return FaultConfig(fault=kind, side=side, rate=rate, delay_s=0.05)


PRODUCER, CONSUMER = FaultSide.PRODUCER, FaultSide.CONSUMER
FAULTY_PREFILLS = [
    _fault(FaultKind.BITFLIP, PRODUCER, 0.25),
    _fault(FaultKind.STALE, PRODUCER, 0.15),
    _fault(FaultKind.SLOW, PRODUCER, 0.2),
]
FAULTY_DECODES = [
    _fault(FaultKind.ZERO, CONSUMER, 0.15),
    _fault(FaultKind.HANG, CONSUMER, 0.03),
    _fault(FaultKind.SHIFT, CONSUMER, 0.1),
]


async def test_mixed_faults_and_departing_clients_never_get_bad_kv_or_leave_kv_held():
    specs = [
        *(
            EngineSpec(role=Role.PRODUCER, fault=f, fault_seed=i)
            for i, f in enumerate(FAULTY_PREFILLS)
        ),
        *(
            EngineSpec(role=Role.CONSUMER, fail_closed=True, fault=f, fault_seed=10 + i)
            for i, f in enumerate(FAULTY_DECODES)
        ),
        EngineSpec(role=Role.BOTH),
    ]
    rng = random.Random(7)
    outcomes: collections.Counter[str] = collections.Counter()
    wrong: list[Any] = []
    async with fake_engines(*specs) as urls:
        prefills, decodes, mono = urls[:3], urls[3:6], urls[6]
        config = make_config(
            prefills,
            decodes,
            timeouts={"decode_first_token_s": 1.0},
            retry={"max_attempts": MAX_ATTEMPTS, "backoff_base_s": 0.001},
            ejection={"instance_failures": 5, "cooldown_s": 2.0},
        )
        async with running_proxy(config) as px, aiohttp.ClientSession() as s:
            want = {}
            for route in ROUTES:
                for prompt in PROMPTS:
                    async with s.post(
                        mono + route, json=body(route, prompt, False, 8)
                    ) as resp:
                        want[route, prompt] = text_of(route, await resp.json())

            async def one(client: aiohttp.ClientSession) -> None:
                route, prompt = rng.choice(ROUTES), rng.choice(PROMPTS)
                stream, leave = rng.random() < 0.5, rng.random()
                payload = body(route, prompt, stream, 8)
                if leave < 0.05:  # gone before any answer
                    task = asyncio.create_task(
                        client.post(px.url + route, json=payload)
                    )
                    await asyncio.sleep(rng.random() * 0.05)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        (await task).close()
                    outcomes["left"] += 1
                    return
                async with client.post(px.url + route, json=payload) as resp:
                    if stream and leave < 0.1 and resp.status == 200:
                        await resp.content.readuntil(b"\n\n")
                        resp.close()  # gone mid-stream
                        outcomes["left"] += 1
                        return
                    if stream and resp.status == 200:
                        text, errors = await read_sse(resp)
                    else:
                        reply = await resp.json()
                        if resp.status == 503 and "No instance could serve" in str(
                            reply
                        ):
                            outcomes["unserved"] += 1
                            return
                        errors = [] if resp.status == 200 else [reply]
                        text = text_of(route, reply) if resp.status == 200 else ""
                if errors or text != want[route, prompt]:
                    wrong.append((route, stream, resp.status, errors, text))
                else:
                    outcomes["right"] += 1

            left = list(range(REQUESTS))

            async def client_loop() -> None:
                async with aiohttp.ClientSession() as client:
                    while left:
                        left.pop()
                        await one(client)

            await asyncio.gather(*(client_loop() for _ in range(CONCURRENCY)))
            # Aborts of departed clients' legs are on their way.
            held = running = -1.0
            for _ in range(100):
                held = sum(
                    [
                        await fetch_metric(s, u, "kvguard_kv_blocks_held")
                        for u in prefills
                    ]
                )
                running = sum(
                    [
                        await fetch_metric(s, u, "vllm:num_requests_running")
                        for u in decodes
                    ]
                )
                if held == running == 0:
                    break
                await asyncio.sleep(0.05)
            metrics = await px.metrics()
    assert not wrong, wrong[:5]
    assert outcomes["unserved"] <= MAX_UNSERVED, outcomes
    assert outcomes["right"] >= REQUESTS * 0.8, outcomes
    assert held == 0 and running == 0
    assert metric(metrics, "kvguard_proxy_in_flight") == 0
    # The faults struck, and departures were seen as such.
    assert metric(metrics, "kvguard_proxy_retries_total", reason="kv_integrity") > 10
    assert metric(metrics, "kvguard_proxy_retries_total", reason="decode_timeout") > 0
    assert (
        metric(metrics, "kvguard_proxy_requests_total", outcome="client_disconnected")
        > 0
    )
