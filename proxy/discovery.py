"""DNS discovery: a ``dns: host:port`` pool entry is every address the name has.

Each round resolves every such entry (A and AAAA records, through the system
resolver or the configured nameservers) and reconciles its pool:

- a new address becomes an Instance that starts *unhealthy*, so it takes no
  traffic until a health probe passes (one is sent at once);
- an address that left DNS is drained: requests in flight on it finish, no
  new one is routed to it, and it is removed once idle;
- an address that comes back while draining is undrained;
- an address two ``dns:`` entries of a pool share is listed once, and kept
  while either name has it: when the one that found it drops it, the other
  takes it over (live state and all) instead of draining it;
- what the admin API said of an address holds across lookups: one it
  removed is not added back (until it adds it again, or a reload restores
  the file's pools), one it drained stays drained when DNS drops it and
  returns it;
- a failed lookup (timeout, NXDOMAIN, refused) keeps the addresses last seen:
  a DNS outage must not empty a pool, and health probes still guard them.

This is how a headless Kubernetes Service, Consul DNS or Docker Compose
expose replicas. Kubernetes API discovery (pods by label) is not offered: DNS
needs no cluster credentials and works the same outside Kubernetes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import AsyncResolver, ThreadedResolver
from prometheus_client import Counter, Gauge
from yarl import URL

from proxy.config import ConfigError, DiscoveryConfig, InstanceConfig
from proxy.instances import Instance, Key, Pool
from proxy.metrics import remove_series

if TYPE_CHECKING:
    from proxy.state import ProxyState

log = logging.getLogger("kvguard.proxy.discovery")


def split_dns_name(name: str) -> tuple[str, int]:
    """``host:port`` (as ``normalize_dns_name`` returns it) as (host, port)."""
    host, _, port = name.rpartition(":")
    return host.strip("[]"), int(port)


def instance_url(address: str, port: int) -> str:
    """The base URL of the instance at ``address`` (IPv4 or IPv6) and ``port``."""
    return str(URL.build(scheme="http", host=address, port=port))


def make_resolver(config: DiscoveryConfig) -> AbstractResolver:
    """aiohttp's resolver for ``config``: c-ares on the nameservers, or getaddrinfo.

    Raises:
        RuntimeError: nameservers are configured but aiodns is not installed.
    """
    if config.nameservers is None:
        return ThreadedResolver()
    return AsyncResolver(
        nameservers=list(config.nameservers), timeout=config.timeout_s, tries=2
    )


class Discovery:
    """Resolves the state's ``dns:`` entries on an interval and reconciles pools."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._resolver: AbstractResolver | None = None
        self._resolver_config: DiscoveryConfig | None = None
        self._wake = asyncio.Event()
        # Instances this module drained because their address left DNS.
        self._draining: set[Instance] = set()
        # Each name's last successful answer (instance URLs).
        self._seen: dict[str, set[str]] = {}
        # The admin API's word on addresses DNS may bring back, by Instance.key:
        # the ones it removed, and the ones it drained.
        self._removed: set[Key] = set()
        self._drained: set[Key] = set()
        # Names with metric series: dropped once no entry names them.
        self._named: set[str] = set()
        registry = state.metrics.registry
        self.lookups = Counter(
            "kvguard_proxy_discovery_lookups",
            "DNS lookups of dns: pool entries, by name and outcome (ok or error)",
            ["name", "outcome"],
            registry=registry,
        )
        self.addresses = Gauge(
            "kvguard_proxy_discovery_addresses",
            "Addresses the last successful lookup of a dns: entry returned",
            ["name"],
            registry=registry,
        )

    # ------------------------------------------------------------ the loop

    def wake(self) -> None:
        """Resolves again now (the configuration changed)."""
        self._wake.set()

    async def run(self) -> None:
        """Resolves every entry, then again every ``discovery.interval_s`` (cancel
        to stop)."""
        try:
            while True:
                self._wake.clear()
                try:
                    await self.refresh()
                except Exception:  # a bug here must not end discovery
                    log.exception("DNS discovery round failed")
                try:
                    async with asyncio.timeout(self.state.config.discovery.interval_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            await self.close()

    async def close(self) -> None:
        if self._resolver is not None:
            await self._resolver.close()
            self._resolver = None

    def _entries(self) -> Iterator[tuple[str, Pool, InstanceConfig]]:
        """(model, pool, entry) for every ``dns:`` entry of the current config."""
        for name, model in self.state.config.models.items():
            pools = self.state.models.get(name)
            if pools is None:
                continue
            for role_cfg, pool in (
                (model.prefill, pools.prefill),
                (model.decode, pools.decode),
            ):
                for entry in role_cfg.instances:
                    if entry.dns is not None:
                        yield name, pool, entry

    async def refresh(self) -> None:
        """One round: resolve every distinct name, then reconcile every pool."""
        names = {entry.dns for _, _, entry in self._entries() if entry.dns}
        self._forget_names(self._named - names)
        self._named = names
        if not names:
            self._reap()
            return
        resolver = await self._current_resolver()
        found = await asyncio.gather(*(self.resolve(resolver, n) for n in names))
        answers = {n: a for n, a in zip(names, found, strict=True) if a is not None}
        self._seen.update(answers)
        # The configuration may have been reloaded while we waited: use the new one.
        entries = list(self._entries())
        pool_names: dict[int, list[str]] = {}
        for _, pool, entry in entries:
            pool_names.setdefault(id(pool), []).append(entry.dns or "")
        for model, pool, entry in entries:
            addresses = answers.get(entry.dns or "")
            if addresses is not None:
                others = {
                    url: name
                    for name in pool_names[id(pool)]
                    if name != entry.dns
                    for url in self._seen.get(name, ())
                }
                self._reconcile(model, pool, entry, addresses, others)
            if not self.state.config.health.enabled:
                # No health loop: probe the instances still waiting to enter.
                for inst in pool.instances:
                    if inst.discovered_by == entry.dns and not inst.healthy:
                        self.state.spawn(self.state.health.probe_instance(inst))
        self._reap()

    def _forget_names(self, gone: set[str]) -> None:
        """Drops the metric series of names no entry has any more."""
        for name in gone:
            self._seen.pop(name, None)
        if gone:
            remove_series(self.addresses, ("name",), lambda v: v[0] in gone)
            remove_series(self.lookups, ("name", "outcome"), lambda v: v[0] in gone)

    async def _current_resolver(self) -> AbstractResolver:
        config = self.state.config.discovery
        if self._resolver is None or self._resolver_config != config:
            await self.close()
            self._resolver = make_resolver(config)
            self._resolver_config = config
        return self._resolver

    async def resolve(self, resolver: AbstractResolver, name: str) -> set[str] | None:
        """The instance URLs ``name`` resolves to, or None when the lookup failed."""
        host, port = split_dns_name(name)
        try:
            async with asyncio.timeout(self.state.config.discovery.timeout_s * 2):
                results = await resolver.resolve(host, port, family=socket.AF_UNSPEC)
        except Exception as exc:  # one bad name must not stop the others
            self.lookups.labels(name, "error").inc()
            log.warning("DNS lookup of %s failed, keeping its instances: %s", name, exc)
            return None
        self.lookups.labels(name, "ok").inc()
        urls = {instance_url(r["host"], port) for r in results}
        self.addresses.labels(name).set(len(urls))
        return urls

    # -------------------------------------------------------- reconciling

    def _reconcile(
        self,
        model: str,
        pool: Pool,
        entry: InstanceConfig,
        urls: set[str],
        others: dict[str, str],
    ) -> None:
        """Makes ``pool``'s instances from ``entry`` match ``urls``.

        ``others`` maps the URLs the pool's other ``dns:`` entries last saw
        to one such name: an address one of them still has is handed over,
        not drained, and a draining address ``urls`` has again is taken over.
        """
        assert entry.dns is not None
        for inst in pool.instances:
            if (
                inst in self._draining
                and inst.discovered_by not in (None, entry.dns)
                and inst.url in urls
            ):
                inst.discovered_by = entry.dns
        mine = {i.url: i for i in pool.instances if i.discovered_by == entry.dns}
        taken = {i.url for i in pool.instances}
        for url, inst in mine.items():
            if url not in urls and url in others:
                inst.discovered_by = others[url]
            if url in urls or url in others:
                if inst in self._draining:
                    self._draining.discard(inst)
                    inst.drained = inst.key in self._drained
                    log.warning(
                        "%s %s is back in DNS (%s)", pool.role, url, inst.discovered_by
                    )
            elif inst not in self._draining:
                self._draining.add(inst)
                inst.drained = True
                log.warning(
                    "%s %s left DNS (%s): draining (%d in flight)",
                    pool.role,
                    url,
                    entry.dns,
                    inst.in_flight,
                )
        new = sorted(
            url for url in urls - taken if (model, pool.role, url) not in self._removed
        )
        if not new:
            return
        try:
            key = self.state.auth.instance_key(entry)
        except ConfigError as exc:
            log.error("cannot add instances found by %s: %s", entry.dns, exc)
            return
        added = []
        for url in new:
            inst = Instance(url, pool.role, model, entry.weight, key)
            inst.discovered_by = entry.dns
            # Out of rotation until a health probe passes.
            inst.healthy = inst.admitted = False
            inst.drained = inst.key in self._drained
            added.append(inst)
            log.warning(
                "%s %s found in DNS (%s): in rotation once a health probe passes",
                pool.role,
                url,
                entry.dns,
            )
        pool.instances = [*pool.instances, *added]
        for inst in added:
            self.state.spawn(self.state.health.probe_instance(inst))

    def last_answers(self) -> Mapping[str, Collection[str]]:
        """Each name's last successful answer (instance URLs), for names the
        configuration had at the last round."""
        return self._seen

    def release(self, inst: Instance) -> None:
        """``inst`` is configured by url now: if its address had left DNS, it
        is undrained and never reaped."""
        if inst in self._draining:
            self._draining.discard(inst)
            inst.drained = inst.key in self._drained

    # ------------------------------------------------ the admin API's word

    def removed_by_admin(self, gone: Collection[Instance]) -> None:
        """The admin API removed ``gone``: DNS must not undo that at its next
        lookup, so their addresses stay out until the admin API adds them
        again or a reload restores the file's pools."""
        for inst in gone:
            self._removed.add(inst.key)
            self._drained.discard(inst.key)
            if inst.discovered_by is not None:
                log.warning(
                    "%s %s removed through the admin API: %s will not add it back "
                    "until it is added again or the configuration is reloaded",
                    inst.role,
                    inst.url,
                    inst.discovered_by,
                )

    def added_by_admin(self, inst: Instance) -> None:
        """The admin API added ``inst``: its address is no longer held out."""
        self._removed.discard(inst.key)

    def drained_by_admin(self, inst: Instance, drained: bool) -> None:
        """The admin API drained or undrained ``inst``. Its drain outlives the
        address leaving DNS and returning (a new Instance then); its undrain
        does not readmit an address that left DNS."""
        if drained:
            self._drained.add(inst.key)
        else:
            self._drained.discard(inst.key)
        inst.drained = drained or inst in self._draining

    def forget_removals(self) -> None:
        """A reload restores the file's pools: every address of a ``dns:``
        entry again, as every ``url:`` entry."""
        self._removed.clear()

    def _reap(self) -> None:
        """Removes drained-out instances whose requests have all finished."""
        idle = {i for i in self._draining if i.in_flight == 0 or i.removed}
        if not idle:
            return
        self._draining -= idle
        for inst in idle:
            if not inst.removed:
                log.warning("%s %s drained and removed", inst.role, inst.url)
        self.state.remove_instances(idle)
