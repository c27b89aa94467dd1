"""Retries and what they charge: each attempt goes where it can still help,
the total timeout bounds them, and only an instance's own faults count
against it."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
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


def _one_strike(prefills: list[StubEngine], decodes: list[StubEngine]) -> ProxyConfig:
    """Quick leg timeouts, and one failure takes an instance out."""
    return make_config(
        [s.url for s in prefills],
        [s.url for s in decodes],
        timeouts={"prefill_s": 1.0, "decode_first_token_s": 1.0, "stream_idle_s": 1.0},
        retry={"max_attempts": 2, "backoff_base_s": 0},
        health={"interval_s": 30, "unhealthy_threshold": 1},
    )


async def test_a_prefill_slow_everywhere_takes_no_prefill_out(stubs):
    # A prompt whose prefill outlasts prefill_s on any instance.
    p1, p2 = await stubs(prefill_delay=30), await stubs(prefill_delay=30)
    d = await stubs()
    async with running_proxy(_one_strike([p1, p2], [d])) as px:
        resp = await px.post("/v1/completions", {"prompt": "huge", "max_tokens": 2})
        assert resp.status == 503, await resp.text()
        prefills = px.state.pools_for("m").prefill.instances
        assert all(p.healthy and p.consecutive_failures == 0 for p in prefills)
        metrics = await px.metrics()
    assert len(p1.requests) == len(p2.requests) == 1
    # Still counted as what each prefill did, though against neither.
    assert metric(metrics, "kvguard_proxy_upstream_failures_total") == 2


@pytest.mark.parametrize("stream", [True, False])
async def test_a_first_token_slow_everywhere_takes_no_decode_out(stubs, stream):
    p, d1, d2 = await stubs(), await stubs("hang"), await stubs("hang")
    async with running_proxy(_one_strike([p], [d1, d2])) as px:
        body = {"prompt": "huge", "max_tokens": 2, "stream": stream}
        resp = await px.post("/v1/completions", body)
        assert resp.status == 503, await resp.text()
        decodes = px.state.pools_for("m").decode.instances
        assert all(d.healthy and d.consecutive_failures == 0 for d in decodes)
    assert len(d1.requests) == len(d2.requests) == 1


async def test_a_decode_stream_slow_everywhere_takes_no_decode_out(stubs):
    # A non-streaming request, collected from streams that stall on every decode.
    p, d1, d2 = await stubs(), await stubs(chunk_delay=30), await stubs(chunk_delay=30)
    async with running_proxy(_one_strike([p], [d1, d2])) as px:
        resp = await px.post("/v1/completions", {"prompt": "huge", "max_tokens": 2})
        assert resp.status == 503, await resp.text()
        assert "idle" in (await resp.json())["error"]["message"]
        decodes = px.state.pools_for("m").decode.instances
        assert all(d.healthy and d.consecutive_failures == 0 for d in decodes)
    assert len(d1.requests) == len(d2.requests) == 1


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_leg_timing_out_where_another_serves_the_request_counts_against_it(
    stubs, leg
):
    slow = await stubs("hang", prefill_delay=30)  # stuck as either leg
    good, other = await stubs(), await stubs()
    pools = ([slow, good], [other]) if leg == "prefill" else ([other], [slow, good])
    async with running_proxy(_one_strike(*pools)) as px:
        for _ in range(2):  # round robin: one of the two tries the slow one
            body = {"prompt": "hi", "max_tokens": 2, "stream": True}
            resp = await px.post("/v1/completions", body)
            assert resp.status == 200, await resp.text()
            await resp.read()
        pool = getattr(px.state.pools_for("m"), leg)
        healthy = {inst.url: inst.healthy for inst in pool.instances}
    assert healthy == {slow.url: False, good.url: True}


class _FailsOnce(StubEngine):
    """A stub whose first reply is a 500; it serves every request after."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._answer(request)
        self.mode = "ok"
        return resp


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_an_instance_that_served_the_request_is_not_counted_failed_for_it(
    stubs, leg
):
    flaky = _FailsOnce(mode="error500")
    await flaky.start()
    try:
        other = await stubs()
        pools = ([flaky], [other]) if leg == "prefill" else ([other], [flaky])
        async with running_proxy(_one_strike(*pools)) as px:
            resp = await px.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert resp.status == 200, await resp.text()
            (inst,) = getattr(px.state.pools_for("m"), leg).instances
            assert inst.healthy and inst.consecutive_failures == 0
    finally:
        await flaky.stop()
    assert len(flaky.requests) == 2  # failed once, then served
