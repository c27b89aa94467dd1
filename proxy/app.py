"""The proxy application: the small endpoints and the wiring.

The state the handlers share is ``proxy.state.ProxyState``; the request flow
is ``proxy.flow``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.admin import add_admin_routes
from proxy.auth import bearer
from proxy.config import ANY_MODEL, ProxyConfig
from proxy.errors import error_response
from proxy.flow import Flow
from proxy.instances import Instance
from proxy.served import served_models
from proxy.server import json_errors, json_route
from proxy.state import STATE, ProxyState
from proxy.status import status_page

_encode_json = msgspec.json.Encoder().encode


async def _liveness(request: web.Request) -> web.Response:
    """200 while the proxy's event loop answers, whatever its backends do.

    For a liveness probe: restarting the proxy brings no backend back, so
    only a proxy that cannot answer at all should be restarted.
    """
    return web.json_response({"status": "ok"})


async def _health(request: web.Request) -> web.Response:
    """200 while every model has a usable prefill and decode instance.

    Served as ``/health`` and ``/readiness`` (vllm-router's name).
    """
    state = request.app[STATE]
    problems = []
    for name, pools in state.models.items():
        for pool in (pools.prefill, pools.decode):
            if not any(i.usable() for i in pool.instances):
                problems.append(f"model {name}: no healthy {pool.role} instance")
    if problems:
        return web.json_response(
            {"status": "unhealthy", "problems": problems}, status=503
        )
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    """Prometheus text; behind ``auth.metrics_key_*`` when configured."""
    state = request.app[STATE]
    if state.auth.metrics.required and not state.auth.metrics.accepts(
        bearer(request.headers)
    ):
        return error_response(401, "Invalid or missing metrics key")
    registry = state.metrics.registry
    body = await asyncio.to_thread(generate_latest, registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _models(request: web.Request) -> web.Response:
    """The union of the backends' /v1/models (configured names as a fallback)."""
    state = request.app[STATE]
    if state.auth.clients.required and not state.auth.clients.accepts(
        bearer(request.headers)
    ):
        return error_response(401, "Invalid or missing API key")
    by_url: dict[str, Instance] = {}
    for inst in state.all_instances():
        if inst.usable():
            by_url.setdefault(inst.url, inst)

    cfg = state.config
    fetches = (
        served_models(
            state.session, inst, cfg.health.timeout_s, cfg.limits.max_reply_bytes
        )
        for inst in by_url.values()
    )
    union: dict[str, dict[str, Any]] = {}
    for entries in await asyncio.gather(*fetches):
        for entry in entries:
            union.setdefault(str(entry["id"]), entry)
    for name in state.models:
        if name != ANY_MODEL and name not in union:
            union[name] = {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "kvguard",
            }
    return web.Response(
        body=_encode_json({"object": "list", "data": list(union.values())}),
        content_type="application/json",
    )


def create_app(
    config: ProxyConfig,
    source: str | Path | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> web.Application:
    """The proxy's aiohttp application for ``config``.

    ``source`` is the YAML file that SIGHUP and POST /admin/reload re-read;
    ``overrides`` (section -> field -> value, from the command line) apply
    on top of it each time.
    Run it with ``proxy.server.ProxyRunner`` (errors aiohttp answers itself
    then come in OpenAI JSON too) and ``handler_cancellation=True``, so that
    a client's disconnect cancels both legs (``proxy.cli`` does both).

    Raises:
        ConfigError: a key the configuration names cannot be read.
    """
    state = ProxyState(config, None if source is None else str(source), overrides)
    # Body size is enforced by the flow, which answers 413 in OpenAI JSON.
    app = web.Application(client_max_size=1 << 40, middlewares=[json_errors])
    app[STATE] = state
    flow = Flow(state)
    app.add_routes(
        [
            json_route("POST", "/v1/completions", flow.completions),
            json_route("POST", "/v1/chat/completions", flow.chat),
            json_route("GET", "/v1/models", _models),
            json_route("GET", "/health", _health),
            json_route("GET", "/readiness", _health),
            json_route("GET", "/liveness", _liveness),
            json_route("GET", "/metrics", _metrics),
            json_route("GET", "/status", status_page),
        ]
    )
    add_admin_routes(app, STATE)
    app.on_startup.append(state.start)
    app.on_cleanup.append(state.stop)
    return app
