"""What outlives one request: the shared state every handler of the proxy reads.

ProxyState holds the configuration, the pools, the one pooled ClientSession,
the integrity tracker and metrics. A reload swaps configuration and pools in
place; requests in flight keep the Instance objects they picked.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Collection, Coroutine, Iterator, Mapping
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from proxy.auth import Auth
from proxy.config import (
    ANY_MODEL,
    ConfigError,
    InstanceConfig,
    PoolConfig,
    ProxyConfig,
    Role,
    load_config,
    with_overrides,
)
from proxy.discovery import Discovery
from proxy.ejection import Ejection, IntegrityTracker
from proxy.health import Health
from proxy.instances import Instance, Key, ModelPools, Pool
from proxy.metrics import ProxyMetrics
from proxy.routing import Router
from proxy.upstream import Upstream

log = logging.getLogger("kvguard.proxy")

_encode_json = msgspec.json.Encoder().encode

# How many KV integrity failures the proxy keeps for /status.
RECENT_FAILURES = 50


class ProxyState:
    """Everything the handlers share; one per application."""

    def __init__(
        self,
        config: ProxyConfig,
        source: str | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.source = source
        # The command line's settings, on top of every reloaded file too.
        self.overrides = overrides or {}
        self._reload_lock = asyncio.Lock()
        self.in_flight = 0  # client requests whose body has arrived
        self.models: dict[str, ModelPools] = {}
        self.metrics = ProxyMetrics(self.all_instances, lambda: self.in_flight)
        self.tracker = IntegrityTracker(config.ejection)
        self.router = Router(self.tracker)
        self.health = Health(self)
        self.discovery = Discovery(self)
        # The last KV integrity failures (their attempt log entries), for /status.
        self.recent_failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        self._session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self.config = config
        self.apply(config)

    # ------------------------------------------------------------ configuration

    def apply(
        self, config: ProxyConfig, joining: Mapping[Key, Instance] | None = None
    ) -> None:
        """Makes ``config`` current, keeping the state of instances it still lists.

        An instance it adds is taken from ``joining`` (a reload probes them
        first), or else made and trusted at once (:meth:`start` then probes
        the first configuration's).

        Raises:
            ConfigError: a key named in ``auth`` or an instance cannot be read;
                nothing changes then.
        """
        auth = Auth.from_config(config.auth)
        # Every key is read before anything changes: a failed reload changes nothing.
        keys = {id(entry): auth.instance_key(entry) for _, _, entry in _entries(config)}
        models: dict[str, ModelPools] = {}
        old: dict[Key, Instance] = {i.key: i for i in self.all_instances()}
        kept: set[Instance] = set()
        new = joining or {}
        seen = self.discovery.last_answers()
        for name, model in config.models.items():
            models[name] = ModelPools(
                self._pool(name, "prefill", model.prefill, keys, old, kept, new, seen),
                self._pool(name, "decode", model.decode, keys, old, kept, new, seen),
            )
        for inst in kept:
            if inst.discovered_by is None:
                # Configured by url now, though discovery may have drained it.
                self.discovery.release(inst)
            if not config.health.enabled and not inst.healthy:
                # Nothing probes it any more: it would stay out for good.
                inst.healthy = True
                inst.consecutive_failures = 0
        self.config = config
        self.auth = auth
        self.models = models
        self._retire([inst for inst in old.values() if inst not in kept])
        self.tracker.config = config.ejection
        t = config.timeouts
        self.prefill_timeout = aiohttp.ClientTimeout(
            total=t.prefill_s, sock_connect=t.connect_s
        )
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=t.connect_s
        )
        level = getattr(logging, config.logging.level.upper())
        logging.getLogger("kvguard.proxy").setLevel(level)
        self.discovery.forget_removals()
        self.discovery.wake()

    @staticmethod
    def _pool(
        model: str,
        role: Role,
        cfg: PoolConfig,
        keys: dict[int, str | None],
        old: dict[Key, Instance],
        kept: set[Instance],
        joining: Mapping[Key, Instance],
        seen: Mapping[str, Collection[str]],
    ) -> Pool:
        """A pool for ``cfg``, reusing the Instance objects already serving it.

        An address a ``url:`` entry lists is that entry's, even when a
        ``dns:`` entry of the pool found it first: listed once, never
        drained for leaving DNS. An address found by a name ``cfg`` no
        longer has is taken over by an entry whose name last answered it
        (``seen``), live state and all, as discovery hands over an address
        two names share.
        """
        configured = {e.url for e in cfg.instances if e.url is not None}
        names = {e.dns for e in cfg.instances if e.dns is not None}
        instances = []
        for inst_cfg in cfg.instances:
            key = keys[id(inst_cfg)]
            if inst_cfg.url is None:
                # A dns: entry keeps what discovery found; it resolves again now.
                answered = seen.get(inst_cfg.dns or "", ())
                for found in old.values():
                    if (
                        (found.model, found.role) == (model, role)
                        and found.url not in configured
                        and found not in kept
                        and (
                            found.discovered_by == inst_cfg.dns
                            or (
                                found.discovered_by not in names
                                and found.discovered_by is not None
                                and found.url in answered
                            )
                        )
                    ):
                        found.discovered_by = inst_cfg.dns
                        found.weight = inst_cfg.weight
                        found.set_api_key(key)
                        kept.add(found)
                        instances.append(found)
                continue
            inst = old.get((model, role, inst_cfg.url))
            if inst is None:
                inst = joining.get((model, role, inst_cfg.url)) or Instance(
                    inst_cfg.url, role, model, inst_cfg.weight, key
                )
            else:
                inst.weight = inst_cfg.weight
                inst.set_api_key(key)
                inst.discovered_by = None
                kept.add(inst)
            instances.append(inst)
        return Pool(role, cfg.policy, instances)

    async def reload(self) -> bool:
        """Re-reads the configuration file; keeps the old one on error.

        Reloads run one at a time: two SIGHUPs never apply an older read of
        the file after a newer one.
        """
        if self.source is None:
            log.warning("reload requested, but the proxy was started without --config")
            return False
        async with self._reload_lock:
            return await self._reload(self.source)

    async def _reload(self, source: str) -> bool:
        try:
            config = await asyncio.to_thread(load_config, source)
            config = with_overrides(config, self.overrides)
            old_server = self.config.server
            new = config.model_copy(update={"server": old_server})
            joining = self._joining(new)
            if self._upstream is not None:
                # Probed while the running pools still serve: replacing an
                # instance leaves no moment without a usable one.
                await self.health.first_probe(joining.values(), new.health)
            self.apply(new, joining)
        except ConfigError as exc:
            log.error("reload failed, keeping the running configuration:\n%s", exc)
            return False
        if config.server != old_server:
            log.warning("server.host/port changes need a restart; ignored on reload")
        log.warning("configuration reloaded from %s", self.source)
        return True

    def _joining(self, config: ProxyConfig) -> dict[Key, Instance]:
        """The instances ``config`` lists by url that no pool has yet, made
        but in no pool.

        Raises:
            ConfigError: a key ``config`` names cannot be read.
        """
        auth = Auth.from_config(config.auth)
        listed = {i.key for i in self.all_instances()}
        return {
            (name, role, entry.url): Instance(
                entry.url, role, name, entry.weight, auth.instance_key(entry)
            )
            for name, role, entry in _entries(config)
            if entry.url is not None and (name, role, entry.url) not in listed
        }

    def remove_instances(self, gone: Collection[Instance]) -> None:
        """Takes ``gone`` out of every pool; requests in flight on them finish."""
        for pools in self.models.values():
            for pool in (pools.prefill, pools.decode):
                if any(i in gone for i in pool.instances):
                    pool.instances = [i for i in pool.instances if i not in gone]
        self._retire(gone)

    def _retire(self, gone: Collection[Instance]) -> None:
        """``gone`` left the pools: requests in flight on them finish, but
        the tracker forgets them, and so do the metrics where no pool of
        their role lists their URL any more."""
        for inst in gone:
            inst.removed = True
            self.tracker.forget(inst)
        listed = {(i.role, i.url) for i in self.all_instances()}
        for role, url in {(i.role, i.url) for i in gone} - listed:
            self.metrics.forget_instance(role, url)

    def pools_for(self, model: str | None) -> ModelPools | None:
        """The pools serving ``model``; with no model named, the only one configured."""
        if model is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            return self.models.get(ANY_MODEL)
        return self.models.get(model) or self.models.get(ANY_MODEL)

    def all_instances(self) -> Iterator[Instance]:
        for pools in self.models.values():
            yield from pools.prefill.instances
            yield from pools.decode.instances

    def find(
        self, url: str, role: str | None = None, model: str | None = None
    ) -> list[Instance]:
        return [
            i
            for i in self.all_instances()
            if i.url == url
            and (role is None or i.role == role)
            and (model is None or i.model == model)
        ]

    # ---------------------------------------------------------- running parts

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's client session is not started")
        return self._session

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("the proxy's client session is not started")
        return self._upstream

    async def start(self, app: web.Application | None = None) -> None:
        """Opens the pooled session, probes the configured instances once
        (with health checks on, each takes traffic only once a probe passes)
        and starts health checks.

        ``timeouts.backend_keepalive_s`` is read here: a reload keeps the pool.
        """
        reconnects = self.metrics.reconnects
        self._upstream = Upstream(
            self.config.timeouts.backend_keepalive_s,
            lambda role: reconnects.labels(role).inc(),
        )
        self._session = self._upstream.session
        configured = list(self.all_instances())
        # Before the proxy listens: an instance still starting (or gone)
        # takes no traffic until a probe passes, and /readiness says so.
        await self.health.first_probe(configured)
        for inst in configured:
            if not inst.healthy:
                log.warning(
                    "%s %s failed its first health probe: out of rotation "
                    "until one passes",
                    inst.role,
                    inst.url,
                )
        self._health_task = asyncio.create_task(
            self.health.run(probed=bool(configured))
        )
        self._discovery_task = asyncio.create_task(self.discovery.run())

    async def stop(self, app: web.Application | None = None) -> None:
        """Stops health checks, lets background aborts finish, closes the session."""
        for task in (self._health_task, self._discovery_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2)
        if self._upstream is not None:
            await self._upstream.close()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort(self, inst: Instance, request_ids: list[str]) -> None:
        """POST /inference/v1/abort_requests, best effort.

        The fake engine then frees a prefill's KV and stops a decode; vLLM
        0.32 matches none of these ids (docs/wire.md#abort), and the closed
        connection stops a running leg there.
        """
        try:
            async with self.session.post(
                inst.abort_url,
                data=_encode_json({"request_ids": request_ids}),
                headers=inst.headers,
                timeout=aiohttp.ClientTimeout(
                    total=5, sock_connect=self.config.timeouts.connect_s
                ),
            ) as resp:
                await resp.read()
                if resp.status >= 300:
                    log.debug("abort on %s answered %d", inst.url, resp.status)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("abort on %s failed: %r", inst.url, exc)

    def on_ejection(self, ejection: Ejection) -> None:
        """Counts and logs an ejection decided by the integrity tracker."""
        inst = ejection.instance
        cooldown = self.config.ejection.cooldown_s
        if ejection.partner is None:
            self.metrics.ejections.labels(inst.role, inst.url, "instance").inc()
            log.warning(
                "%s %s ejected for %.0fs after %d KV integrity failures",
                inst.role,
                inst.url,
                cooldown,
                ejection.failures,
            )
        else:
            partner = ejection.partner
            self.metrics.ejections.labels(inst.role, inst.url, "pair").inc()
            log.warning(
                "pair prefill %s / decode %s ejected for %.0fs after %d KV integrity "
                "failures",
                inst.url,
                partner.url,
                cooldown,
                ejection.failures,
            )


STATE = web.AppKey("kvguard_proxy_state", ProxyState)


def _entries(config: ProxyConfig) -> Iterator[tuple[str, Role, InstanceConfig]]:
    """Every instance entry of ``config``: its model, role and entry."""
    for name, model in config.models.items():
        yield from ((name, "prefill", entry) for entry in model.prefill.instances)
        yield from ((name, "decode", entry) for entry in model.decode.instances)
