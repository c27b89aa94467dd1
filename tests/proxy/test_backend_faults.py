"""Backends that fail in ways that say nothing about their health, or hang:
the proxy must neither eject them nor keep a client waiting (issue 10)."""

from __future__ import annotations

import asyncio

from proxy_helpers import make_config, run_proxy

from proxy.config import TimeoutsConfig

COMPLETION = {"prompt": "hi", "max_tokens": 4}


def test_pooled_connections_are_dropped_before_vllms_idle_timeout():
    # uvicorn (vLLM's server) closes keep-alive connections idle for 5 s.
    assert TimeoutsConfig().backend_keepalive_s < 5


async def test_reset_on_a_reused_connection_is_retried_and_not_held_against_it(
    stubs,
):
    p, d = await stubs(reset_idle_s=0.2), await stubs(reset_idle_s=0.2)
    config = make_config(
        [p.url],
        [d.url],
        timeouts={"backend_keepalive_s": 30},  # keep them past the backends' 0.2 s
        health={"interval_s": 30, "unhealthy_threshold": 1},
    )
    async with run_proxy(config) as px:
        for stream in (False, True, False, True):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert resp.status == 200, await resp.text()
            await resp.read()
            await asyncio.sleep(0.3)
        metrics = await px.metrics()
        instances = list(px.state.all_instances())
    # Every other request reuses a pooled connection (a retry's is not kept).
    assert p.resets == d.resets == 2
    assert all(i.healthy and i.consecutive_failures == 0 for i in instances)
    assert "kvguard_proxy_upstream_failures_total{" not in metrics
    assert "kvguard_proxy_retries_total{" not in metrics
    assert 'kvguard_proxy_backend_reconnects_total{role="prefill"}' in metrics
