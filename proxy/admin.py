"""The admin API (admin key required): list, add, remove, drain, undrain, reload.

    GET    /admin/instances
    POST   /admin/instances           {"role", "url", "model"?, "weight"?,
                                       "api_key_env"?}
                                      (api_key_env: KVGUARD_BACKEND_KEY_* only)
    DELETE /admin/instances           {"url", "role"?, "model"?}
    POST   /admin/instances/drain     {"url", "role"?, "model"?}
    POST   /admin/instances/undrain   {"url", "role"?, "model"?}
    POST   /admin/reload              re-read the configuration file (as SIGHUP)

Changes made here live until the next reload, which restores the file's pools;
until then DNS discovery does not undo them (see ``proxy.discovery``). An
instance added here is probed before it joins, and with health checks on it
takes traffic only once a probe passes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

import msgspec
from aiohttp import web

from proxy.auth import bearer
from proxy.config import MAX_WEIGHT, ConfigError, Role, normalize_url, read_secret
from proxy.errors import error_response
from proxy.instances import Instance, Pool
from proxy.server import json_route

if TYPE_CHECKING:
    from proxy.state import ProxyState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Select(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: Literal["prefill", "decode"] | None = None
    model: str | None = None


class _Add(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["prefill", "decode"]
    url: str
    model: str | None = None
    weight: float = 1.0
    api_key_env: str | None = None


class _Invalid(Exception):
    pass


# The only variables an admin may name: the API must not send any secret of
# the proxy's environment (its admin key, say) to a URL the admin picks.
BACKEND_KEY_PREFIX = "KVGUARD_BACKEND_KEY_"


def add_admin_routes(app: web.Application, key: web.AppKey[ProxyState]) -> None:
    """Registers the admin endpoints on ``app``; ``key`` finds the ProxyState."""

    def guarded(
        handler: Callable[[ProxyState, web.Request], Awaitable[web.Response]],
    ) -> Handler:
        async def wrapper(request: web.Request) -> web.StreamResponse:
            state = request.app[key]
            if not state.auth.admin.required:
                return error_response(
                    403,
                    "The admin API is disabled: configure auth.admin_key_env or _file",
                )
            if not state.auth.admin.accepts(bearer(request.headers)):
                return error_response(401, "Invalid or missing admin key")
            try:
                return await handler(state, request)
            except _Invalid as exc:
                return error_response(400, str(exc))

        return wrapper

    app.add_routes(
        [
            json_route("GET", "/admin/instances", guarded(_list)),
            json_route("POST", "/admin/instances", guarded(_add)),
            json_route("DELETE", "/admin/instances", guarded(_remove)),
            json_route("POST", "/admin/instances/drain", guarded(_drain)),
            json_route("POST", "/admin/instances/undrain", guarded(_undrain)),
            json_route("POST", "/admin/reload", guarded(_reload)),
        ]
    )


async def _body(request: web.Request, kind: type[msgspec.Struct]) -> msgspec.Struct:
    raw = await request.read()
    if not raw and request.query:
        raw = msgspec.json.encode(dict(request.query))
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _Invalid(f"bad request body: {exc}") from None
    except RecursionError:
        raise _Invalid("bad request body: nested too deeply") from None


def _listing(state: ProxyState) -> web.Response:
    now = time.monotonic()
    return web.json_response(
        {"instances": [i.describe(now) for i in state.all_instances()]}
    )


async def _list(state: ProxyState, request: web.Request) -> web.Response:
    return _listing(state)


async def _selected(state: ProxyState, request: web.Request) -> list[Instance]:
    sel = await _body(request, _Select)
    assert isinstance(sel, _Select)
    try:
        url = normalize_url(sel.url)
    except ValueError as exc:
        raise _Invalid(f"url {exc}") from None
    found = state.find(url, sel.role, sel.model)
    if not found:
        raise _Invalid(
            f"no instance matches url={url} role={sel.role} model={sel.model}"
        )
    return found


async def _drain(state: ProxyState, request: web.Request) -> web.Response:
    for inst in await _selected(state, request):
        state.discovery.drained_by_admin(inst, True)
    return _listing(state)


async def _undrain(state: ProxyState, request: web.Request) -> web.Response:
    for inst in await _selected(state, request):
        state.discovery.drained_by_admin(inst, False)
    return _listing(state)


async def _remove(state: ProxyState, request: web.Request) -> web.Response:
    gone = set(await _selected(state, request))
    for pools in state.models.values():
        for pool in (pools.prefill, pools.decode):
            left = [i for i in pool.instances if i not in gone]
            if not left and len(left) != len(pool.instances):
                raise _Invalid(
                    f"cannot remove the last {pool.role} instance of a model"
                )
    state.remove_instances(gone)
    state.discovery.removed_by_admin(gone)
    return _listing(state)


async def _add(state: ProxyState, request: web.Request) -> web.Response:
    spec = await _body(request, _Add)
    assert isinstance(spec, _Add)
    try:
        url = normalize_url(spec.url)
    except ValueError as exc:
        raise _Invalid(f"url {exc}") from None
    if not 0 < spec.weight <= MAX_WEIGHT:
        raise _Invalid(f"weight must be > 0 and <= {MAX_WEIGHT:g}")
    model = spec.model
    if model is None:
        if len(state.models) != 1:
            raise _Invalid("model is required when several models are configured")
        model = next(iter(state.models))
    _open_pool(state, model, spec.role, url)
    env = spec.api_key_env
    if env is not None and (
        not env.startswith(BACKEND_KEY_PREFIX) or env == BACKEND_KEY_PREFIX
    ):
        raise _Invalid(
            f"api_key_env must name a variable {BACKEND_KEY_PREFIX}<NAME>, got {env!r}"
        )
    try:
        keys = read_secret(env, None, f"{url} api key")
    except ConfigError as exc:
        raise _Invalid(str(exc)) from None
    inst = Instance(
        url, spec.role, model, spec.weight, keys[0] if keys else state.auth.backend_key
    )
    await state.health.first_probe([inst])
    # Looked up again: a reload or another add may have come during the probe.
    pool = _open_pool(state, model, spec.role, url)
    pool.instances = [*pool.instances, inst]
    state.discovery.added_by_admin(inst)
    return _listing(state)


def _open_pool(state: ProxyState, model: str, role: Role, url: str) -> Pool:
    """``model``'s pool of ``role``, which must not list ``url`` yet."""
    pools = state.models.get(model)
    if pools is None:
        raise _Invalid(f"model {model!r} is not configured")
    pool = pools.pool(role)
    if any(i.url == url for i in pool.instances):
        raise _Invalid(f"{role} {url} is already in model {model!r}")
    return pool


async def _reload(state: ProxyState, request: web.Request) -> web.Response:
    if state.source is None:
        return error_response(
            409, "The proxy was started without --config: nothing to reload"
        )
    if not await state.reload():
        return error_response(
            422, "Reload failed; the running configuration is kept (see log)"
        )
    return _listing(state)
