"""DNS discovery against a real dnsmasq: every A/AAAA record of a ``dns:`` pool
entry is an instance; traffic follows the records with no failed request."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult
from ops_helpers import Dnsmasq, Load, complete, eventually

from proxy.config import ConfigError, ProxyConfig, load_config, parse_config
from proxy.discovery import instance_url, split_dns_name
from proxy.instances import Instance
from proxy.testing import RunningProxy, running_proxy
from tests.support.dns import resolved
from tests.support.metrics import metric

torch = pytest.importorskip("torch")

from fake_engine.config import EngineConfig, Role  # noqa: E402
from fake_engine.engine import Engine  # noqa: E402
from fake_engine.server import EngineServer  # noqa: E402

PREFILL_A, PREFILL_B, DEAD, DECODE = "127.0.0.2", "127.0.0.3", "127.0.0.9", "127.0.0.4"


async def _engines_on_one_port(
    specs: dict[str, EngineConfig],
) -> tuple[int, list[EngineServer]]:
    """Starts one engine per address, all on the same free port."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((next(iter(specs)), 0))
            port = int(probe.getsockname()[1])
        servers: list[EngineServer] = []
        try:
            for host, spec in specs.items():
                server = EngineServer(Engine(spec))
                servers.append(server)
                await server.start(host, port)
            return port, servers
        except OSError:
            for server in servers:
                await server.stop()
    raise RuntimeError("no port free on every address")


def _hold_long_prefills(engine: Engine, over_tokens: int) -> asyncio.Event:
    """Holds ``engine``'s steps prefilling more than ``over_tokens`` until the
    returned event is set (after its simulated compute, as usual)."""
    release = asyncio.Event()
    simulate = engine._simulate_compute

    async def held(step: Any, elapsed: float) -> None:
        if step.num_prefill_tokens() > over_tokens:
            await release.wait()
        await simulate(step, elapsed)

    engine._simulate_compute = held  # type: ignore[method-assign]
    return release


async def _sent(session: aiohttp.ClientSession, host: str, port: int) -> float:
    """Prefills served by the engine at ``host``: requests it sent checksums for."""
    async with session.get(f"http://{host}:{port}/metrics") as resp:
        return metric(await resp.text(), "kvguard_kv_checksum_sent_total")


def _pool_urls(proxy_state, role: str = "prefill") -> dict[str, Instance]:
    pools = next(iter(proxy_state.models.values()))
    return {i.url: i for i in pools.pool(role).instances}


async def test_traffic_follows_dns_records_with_no_failed_request():
    # Prefills take ~0.1 s per short prompt, 2 s for the long one below.
    prefill = EngineConfig(role=Role.PRODUCER, prefill_tokens_per_s=500)
    port, servers = await _engines_on_one_port(
        {
            PREFILL_A: prefill,
            PREFILL_B: prefill,
            DECODE: EngineConfig(role=Role.CONSUMER, fail_closed=True),
        }
    )
    dns = Dnsmasq()
    url_a, url_b, url_dead = (
        f"http://{h}:{port}" for h in (PREFILL_A, PREFILL_B, DEAD)
    )
    try:
        dns_port = await dns.start(
            {"prefill.kv.test": [PREFILL_A], "decode.kv.test": [DECODE]}
        )
        config = {
            "models": {
                "*": {
                    "prefill": {"instances": [{"dns": f"prefill.kv.test:{port}"}]},
                    "decode": {"instances": [{"dns": f"decode.kv.test:{port}"}]},
                }
            },
            "discovery": {
                "interval_s": 0.2,
                "timeout_s": 1,
                "nameservers": [f"127.0.0.1:{dns_port}"],
            },
            "health": {"interval_s": 0.2, "timeout_s": 1},
        }
        async with running_proxy(config) as proxy, aiohttp.ClientSession() as http:
            state = proxy.state

            async def healthy() -> bool:
                async with http.get(proxy.url + "/health") as resp:
                    return resp.status == 200

            await eventually(healthy, "the proxy finds its instances in DNS")
            load = Load(proxy.url)
            load.start()

            async def served(host: str, at_least: float) -> bool:
                return await _sent(http, host, port) >= at_least

            await eventually(lambda: served(PREFILL_A, 5), "traffic on the first")

            # A new record, and one whose address answers nothing: the live one
            # enters rotation after its probe; the dead one never does.
            await dns.set_records(
                {
                    "prefill.kv.test": [PREFILL_A, PREFILL_B, DEAD],
                    "decode.kv.test": [DECODE],
                }
            )
            await eventually(lambda: served(PREFILL_B, 5), "traffic on the new one")
            pool = _pool_urls(state)
            assert set(pool) == {url_a, url_b, url_dead}
            assert not pool[url_dead].healthy
            assert pool[url_b].discovered_by == f"prefill.kv.test:{port}"

            # A request in flight on an address that leaves DNS finishes there.
            # A's prefill of the long prompt is held until the test has seen A
            # drained and still listed: a 2 s prefill raced the DNS change
            # (0.3-0.9 s from in flight to drained, measured under load).
            await load.stop()
            long_prompt = "x" * 1000
            release = _hold_long_prefills(servers[0].engine, over_tokens=500)
            async with aiohttp.ClientSession() as client:
                slow = [
                    asyncio.create_task(complete(client, proxy.url, long_prompt, s))
                    for s in (False, True)
                ]
                inst_a = pool[url_a]
                await eventually(lambda: inst_a.in_flight == 1, "a long prefill on A")
                await dns.set_records(
                    {
                        "prefill.kv.test": [PREFILL_B, DEAD],
                        "decode.kv.test": [DECODE],
                    }
                )
                await eventually(lambda: inst_a.drained, "A drained once out of DNS")
                assert url_a in _pool_urls(state), "removed with a request in flight"
                assert inst_a.in_flight == 1
                release.set()
                load.start()
                assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]
            await eventually(lambda: url_a not in _pool_urls(state), "A removed")
            assert inst_a.removed

            # From now on only B serves.
            sent_a = await _sent(http, PREFILL_A, port)
            sent_b = await _sent(http, PREFILL_B, port)
            await eventually(lambda: served(PREFILL_B, sent_b + 5), "traffic on B")
            assert await _sent(http, PREFILL_A, port) == sent_a

            # A reload keeps what discovery found, state and all.
            before = _pool_urls(state)
            state.apply(state.config)
            assert _pool_urls(state) == before

            # DNS down: lookups fail, the instances last seen keep serving.
            dns.stop()

            async def lookups_failing() -> bool:
                async with http.get(proxy.url + "/metrics") as resp:
                    text = await resp.text()
                return (
                    metric(
                        text, "kvguard_proxy_discovery_lookups_total", outcome="error"
                    )
                    >= 2
                )

            await eventually(lookups_failing, "failed lookups counted")
            sent_b = await _sent(http, PREFILL_B, port)
            await eventually(lambda: served(PREFILL_B, sent_b + 3), "B serves on")
            assert set(_pool_urls(state)) == {url_b, url_dead}
            await load.stop()

            async with http.get(proxy.url + "/metrics") as resp:
                proxy_metrics = await resp.text()
        assert load.results and not load.failures, load.failures[:5]
        assert metric(proxy_metrics, "kvguard_proxy_retries_total") == 0
    finally:
        dns.stop()
        for server in servers:
            await server.stop()


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("{dns: prefill.kv.svc}", "must be host:port"),
        ("{dns: 'http://prefill.kv.svc:8100'}", "must be host:port"),
        (
            "{dns: 'prefill.kv.svc:8100', url: 'http://p:1'}",
            "exactly one of url or dns",
        ),
        ("{weight: 2}", "exactly one of url or dns"),
    ],
)
def test_bad_dns_entries_are_config_errors(entry, why):
    text = f"""
models:
  m:
    prefill: {{instances: [{entry}]}}
    decode: {{instances: [{{url: "http://d:8200"}}]}}
"""
    with pytest.raises(ConfigError, match=why):
        parse_config(text, "x.yaml")


def test_nameservers_must_be_addresses():
    base = """
models:
  m:
    prefill: {instances: [{dns: "p.kv:8100"}]}
    decode: {instances: [{dns: "d.kv:8200"}]}
discovery:
  nameservers: %s
"""
    ok = parse_config(base % '["10.96.0.10", "127.0.0.1:5353", "::1", "[::1]:53"]')
    assert ok.discovery.nameservers == [
        "10.96.0.10",
        "127.0.0.1:5353",
        "::1",
        "[::1]:53",
    ]
    assert ok.models["m"].prefill.instances[0].dns == "p.kv:8100"
    with pytest.raises(ConfigError, match=r"discovery.nameservers.*IP:PORT"):
        parse_config(base % '["kube-dns.kube-system"]')


async def test_without_health_checks_discovery_probes_new_instances_itself():
    port, servers = await _engines_on_one_port(
        {
            PREFILL_A: EngineConfig(role=Role.PRODUCER),
            DECODE: EngineConfig(role=Role.CONSUMER, fail_closed=True),
        }
    )
    dns = Dnsmasq()
    try:
        dns_port = await dns.start(
            {"prefill.kv.test": [PREFILL_A, DEAD], "decode.kv.test": [DECODE]}
        )
        config = {
            "models": {
                "*": {
                    "prefill": {"instances": [{"dns": f"prefill.kv.test:{port}"}]},
                    "decode": {"instances": [{"dns": f"decode.kv.test:{port}"}]},
                }
            },
            "discovery": {"interval_s": 0.2, "nameservers": [f"127.0.0.1:{dns_port}"]},
            "health": {"enabled": False},
        }
        async with running_proxy(config) as proxy, aiohttp.ClientSession() as http:

            def usable() -> bool:
                pool = _pool_urls(proxy.state)
                return len(pool) == 2 and pool[f"http://{PREFILL_A}:{port}"].healthy

            await eventually(usable, "the live prefill probed into rotation")
            assert not _pool_urls(proxy.state)[f"http://{DEAD}:{port}"].healthy
            for stream in (False, True):
                status, text = await complete(http, proxy.url, "hello", stream)
                assert status == 200 and text
    finally:
        dns.stop()
        for server in servers:
            await server.stop()


def test_addresses_become_instance_urls():
    assert instance_url("10.1.0.5", 8100) == "http://10.1.0.5:8100"
    assert instance_url("fd00::5", 8100) == "http://[fd00::5]:8100"
    assert split_dns_name("prefill.kv.svc.cluster.local:8100") == (
        "prefill.kv.svc.cluster.local",
        8100,
    )


async def test_the_system_resolver_is_the_default():
    # No nameservers: getaddrinfo, as in a pod (/etc/hosts, resolv.conf).
    port, servers = await _engines_on_one_port(
        {
            "127.0.0.1": EngineConfig(role=Role.PRODUCER),
            PREFILL_B: EngineConfig(role=Role.CONSUMER, fail_closed=True),
        }
    )
    try:
        config = {
            "models": {
                "*": {
                    "prefill": {"instances": [{"dns": f"localhost:{port}"}]},
                    "decode": {"instances": [{"url": f"http://{PREFILL_B}:{port}"}]},
                }
            },
            "discovery": {"interval_s": 0.2},
            "health": {"interval_s": 0.2},
        }
        async with running_proxy(config) as proxy, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}"

            def found() -> bool:
                inst = _pool_urls(proxy.state).get(url)
                return inst is not None and inst.healthy

            await eventually(found, "localhost found by getaddrinfo and probed")
            assert _pool_urls(proxy.state)[url].discovered_by == f"localhost:{port}"
            status, text = await complete(http, proxy.url, "hello", False)
            assert status == 200 and text
    finally:
        for server in servers:
            await server.stop()


async def test_an_address_also_listed_by_url_is_one_configured_instance(tmp_path):
    path = tmp_path / "proxy.yaml"

    def write(listed: bool) -> None:
        url = '\n        - url: "http://127.0.0.1:8200"' if listed else ""
        path.write_text(
            f"""
models:
  '*':
    prefill: {{instances: [{{url: "http://127.0.0.1:8100"}}]}}
    decode:
      instances:
        - dns: "localhost:8200"{url}
discovery: {{interval_s: 3600}}
health: {{interval_s: 3600}}
"""
        )

    write(listed=False)
    async with running_proxy(load_config(path), source=str(path)) as proxy:
        await proxy.state.discovery.refresh()
        found = _pool_urls(proxy.state, "decode")["http://127.0.0.1:8200"]
        assert found.discovered_by == "localhost:8200"
        write(listed=True)
        assert await proxy.state.reload()
        decodes = next(iter(proxy.state.models.values())).decode.instances
        assert decodes.count(found) == 1 and len(decodes) == len(set(decodes))
        assert found.discovered_by is None  # a url: entry's now: never reaped


async def test_a_reload_that_changes_the_nameservers_asks_the_new_ones(tmp_path):
    old, new = Dnsmasq(), Dnsmasq()
    path = tmp_path / "proxy.yaml"

    def write(port: int) -> None:
        path.write_text(
            f"""
models:
  '*':
    prefill: {{instances: [{{url: "http://127.0.0.1:8100"}}]}}
    decode: {{instances: [{{dns: "decode.kv.test:8200"}}]}}
discovery: {{interval_s: 3600, timeout_s: 1, nameservers: ["127.0.0.1:{port}"]}}
health: {{enabled: false}}
"""
        )

    try:
        write(await old.start({"decode.kv.test": [PREFILL_A]}))
        new_port = await new.start({"decode.kv.test": [PREFILL_B]})
        async with running_proxy(load_config(path), source=str(path)) as proxy:
            await proxy.state.discovery.refresh()
            assert list(_pool_urls(proxy.state, "decode")) == [
                f"http://{PREFILL_A}:8200"
            ]
            write(new_port)
            assert await proxy.state.reload()
            await proxy.state.discovery.refresh()
            assert list(_pool_urls(proxy.state, "decode")) == [
                f"http://{PREFILL_B}:8200"
            ]
    finally:
        old.stop()
        new.stop()


class _Resolver(AbstractResolver):
    """Resolves names to 127.0.0.1, but raises what a broken name raises."""

    def __init__(self, broken: str) -> None:
        self.broken = broken

    async def resolve(
        self, host: str, port: int = 0, family: int = socket.AF_INET
    ) -> list[ResolveResult]:
        if host == self.broken:
            raise UnicodeError("label empty or too long")
        return resolved(host, port, ["127.0.0.1"])

    async def close(self) -> None:
        pass


def _dns_config(prefill_dns: str) -> ProxyConfig:
    """A prefill and a decode pool of one dns: entry each, discovery and
    health left to the test."""
    return ProxyConfig.model_validate(
        {
            "models": {
                "*": {
                    "prefill": {"instances": [{"dns": prefill_dns}]},
                    "decode": {"instances": [{"dns": "decode.kv.test:8200"}]},
                }
            },
            "discovery": {"interval_s": 3600},
            "health": {"interval_s": 3600},
        }
    )


def _lookup_errors(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("kvguard_proxy_discovery_lookups_total{") and (
            f'name="{name}",outcome="error"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _use_resolver(proxy: RunningProxy, resolver: AbstractResolver) -> None:
    """Makes ``resolver`` discovery's, once the round run at startup is over
    (the system resolver fails the prefill's name, which no host has)."""
    name = proxy.state.config.models["*"].prefill.instances[0].dns or ""

    async def failed_once() -> bool:
        return _lookup_errors(await proxy.metrics(), name) >= 1

    await eventually(failed_once, "the startup round's lookup failed")
    proxy.state.discovery._resolver = resolver
    proxy.state.discovery._resolver_config = proxy.state.config.discovery


async def test_a_lookup_failing_in_any_way_leaves_the_other_names_resolved():
    name = "broken.kv.test:8100"
    async with running_proxy(_dns_config(name)) as proxy:
        await _use_resolver(proxy, _Resolver("broken.kv.test"))
        before = _lookup_errors(await proxy.metrics(), name)
        await proxy.state.discovery.refresh()
        assert list(_pool_urls(proxy.state, "decode")) == ["http://127.0.0.1:8200"]
        assert _lookup_errors(await proxy.metrics(), name) == before + 1


def test_a_name_no_resolver_can_look_up_is_a_config_error():
    for name in ("typo..kv.svc:8100", "x" * 64 + ".kv.svc:8100"):
        with pytest.raises(ConfigError, match="not a valid host name"):
            parse_config(
                f"models: {{m: {{prefill: {{instances: [{{dns: '{name}'}}]}}, "
                "decode: {instances: [{url: 'http://d:1'}]}}}\n",
                "x.yaml",
            )


async def test_a_name_no_entry_has_any_more_leaves_no_metric_series():
    async with running_proxy(_dns_config("old.kv.test:8100")) as proxy:
        await _use_resolver(proxy, _Resolver("nothing.kv.test"))
        await proxy.state.discovery.refresh()
        assert 'name="old.kv.test:8100"' in await proxy.metrics()
        proxy.state.apply(_dns_config("new.kv.test:8100"))  # as a reload does
        await proxy.state.discovery.refresh()
        metrics = await proxy.metrics()
    assert 'name="old.kv.test:8100"' not in metrics
    assert 'name="new.kv.test:8100"' in metrics
    assert 'name="decode.kv.test:8200"' in metrics
