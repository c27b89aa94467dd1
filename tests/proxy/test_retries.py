"""Retries and what they charge: each attempt goes where it can still help,
the total timeout bounds them, and only an instance's own faults count
against it."""

from __future__ import annotations

import asyncio
import time

import pytest
from proxy_helpers import StubEngine, make_config

from proxy.config import ProxyConfig
from proxy.policy import prefix_hash
from proxy.testing import running_proxy
from tests.support.metrics import metric

PROMPT = "the same prompt prefix"


def _prefix_hash_decodes(stubs: list[StubEngine], **retry: object) -> ProxyConfig:
    return make_config(
        [stubs[0].url],
        [s.url for s in stubs[1:]],
        retry={"backoff_base_s": 0, **retry},
        health={"interval_s": 30},
        decode_policy="prefix_hash",
    )


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_outliving_its_total_timeout_takes_no_instance_out(
    stubs, stream
):
    p, d = await stubs(), await stubs(chunk_delay=0.1)  # 20 tokens: about 2 s
    config = make_config(
        [p.url], [d.url], timeouts={"total_s": 0.5}, health={"interval_s": 30}
    )
    long = {"prompt": "a long story", "max_tokens": 20, "stream": stream}
    async with running_proxy(config) as px:

        async def one() -> int:
            resp = await px.post("/v1/completions", long)
            await resp.read()
            return resp.status

        statuses = await asyncio.gather(one(), one())  # two: the threshold
        resp = await px.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert resp.status == 200, await resp.text()
        metrics = await px.metrics()
    assert statuses == ([200, 200] if stream else [504, 504])
    assert "kvguard_proxy_upstream_failures_total{" not in metrics
    assert metric(metrics, "kvguard_proxy_retries_total") == 0


async def test_a_retry_skips_the_decode_that_failed_when_all_are_ejected(stubs):
    p, da, db = await stubs(), await stubs(), await stubs()
    async with running_proxy(_prefix_hash_decodes([p, da, db])) as px:
        decodes = px.state.pools_for("m").decode.instances
        for d in decodes:  # cooling down: the pool keeps serving
            d.ejected_until = time.monotonic() + 3600
        target = prefix_hash(decodes, PROMPT.encode())
        bad = da if target.url == da.url else db
        bad.mode = "error500"  # where the prompt hashes to
        resp = await px.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        assert resp.status == 200, await resp.text()
    assert len(bad.requests) == 1


async def test_the_decode_only_fallback_skips_the_decode_that_failed(stubs):
    p, da, db = await stubs(), await stubs(), await stubs()
    config = _prefix_hash_decodes(
        [p, da, db], max_attempts=1, on_exhausted="decode_only"
    )
    async with running_proxy(config) as px:
        decodes = px.state.pools_for("m").decode.instances
        target = prefix_hash(decodes, PROMPT.encode())
        bad = da if target.url == da.url else db
        bad.mode = "error500"
        resp = await px.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        assert resp.status == 200, await resp.text()
    assert len(bad.requests) == 1


async def test_a_decode_is_reserved_while_its_prefill_runs(stubs):
    p = await stubs(prefill_delay=0.5)
    da, db = await stubs(chunk_delay=0.2), await stubs(chunk_delay=0.2)
    config = make_config(
        [p.url],
        [da.url, db.url],
        health={"interval_s": 30},
        decode_policy="least_inflight",
    )
    body = {"prompt": "hi", "max_tokens": 10, "stream": True}
    async with running_proxy(config) as px:
        first = await px.post("/v1/completions", body)  # streams for about 2 s
        await first.content.readany()
        busy, idle = (da, db) if da.requests else (db, da)
        # A burst whose prefills all run at once: least_inflight spreads it.
        burst = await asyncio.gather(
            *(px.post("/v1/completions", body) for _ in range(4))
        )
        for resp in [first, *burst]:
            await resp.read()
    # Five streams at once, over two decodes: three and two.
    assert sorted([len(busy.requests), len(idle.requests)]) == [2, 3]


async def test_a_reply_too_large_for_its_own_request_takes_no_decode_out(stubs):
    p1, p2, d1, d2 = await stubs(), await stubs(), await stubs(), await stubs()
    config = make_config(
        [p1.url, p2.url],
        [d1.url, d2.url],
        limits={"max_reply_bytes": 65536},
        retry={"backoff_base_s": 0},
        health={"interval_s": 30, "unhealthy_threshold": 1},
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", {"prompt": "hi", "max_tokens": 2000})
        assert "exceeds 65536 bytes" in (await resp.json())["error"]["message"]
        decodes = px.state.pools_for("m").decode.instances
        assert all(d.healthy and d.consecutive_failures == 0 for d in decodes)
        metrics = await px.metrics()
    # Counted as what each decode answered, though against neither.
    assert 'reason="decode_reply_too_large"' in metrics


async def test_retries_are_counted_only_when_made(stubs):
    p, d = await stubs(), await stubs()
    config = make_config(
        [p.url],
        [d.url],
        retry={"max_attempts": 3, "backoff_base_s": 0},
        health={"interval_s": 30, "unhealthy_threshold": 1},
    )
    async with running_proxy(config) as px:
        await p.stop()  # refused, then out of service: nothing left to retry on
        resp = await px.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert resp.status == 503
        assert metric(await px.metrics(), "kvguard_proxy_retries_total") == 0


async def test_the_backoff_ends_with_the_total_timeout(stubs):
    p1, p2, d = await stubs(), await stubs(), await stubs()
    config = make_config(
        [p1.url, p2.url],
        [d.url],
        retry={"max_attempts": 2, "backoff_base_s": 5.0, "backoff_max_s": 5.0},
        timeouts={"total_s": 0.3},
        health={"interval_s": 30, "unhealthy_threshold": 5},
    )
    async with running_proxy(config) as px:
        await p1.stop()
        await p2.stop()  # each attempt fails at once
        started = time.monotonic()
        resp = await px.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        took = time.monotonic() - started
        assert resp.status == 504, await resp.text()
    assert took < 2.5  # not the 2.5-5 s backoff
