"""How instances enter and leave the pools: the admin API, DNS and reloads together.

DNS answers come from a resolver the test controls, so each lookup is one
``discovery.refresh()`` call; health rounds run only when a test calls them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult
from proxy_helpers import StubEngine, add_prefill, admin, make_config

import proxy.discovery
from proxy.config import load_config
from proxy.testing import RunningProxy, running_proxy
from tests.support.dns import resolved
from tests.support.ports import free_port

COMPLETION = {"prompt": "hi", "max_tokens": 4}
NAME = "prefill.kv.test"


class FakeDns(AbstractResolver):
    """Answers each host name with the IPv4 addresses ``records`` gives it."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}

    async def resolve(
        self, host: str, port: int = 0, family: int = socket.AF_INET
    ) -> list[ResolveResult]:
        return resolved(host, port, self.records.get(host, []))

    async def close(self) -> None:
        pass


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDns]:
    """The resolver every proxy of the test discovers through; the admin key is adm."""
    resolver = FakeDns()
    monkeypatch.setattr(proxy.discovery, "make_resolver", lambda config: resolver)
    monkeypatch.setenv("ADM", "adm")
    yield resolver


def dns_config_yaml(
    configured: str, port: int, decode: str, health: str = "{interval_s: 3600}"
) -> str:
    """A prefill pool of ``configured`` and every address of NAME on ``port``."""
    return f"""
models:
  '*':
    prefill:
      instances:
        - url: "{configured}"
        - dns: "{NAME}:{port}"
    decode: {{instances: [{{url: "{decode}"}}]}}
auth: {{admin_key_env: ADM}}
discovery: {{interval_s: 3600}}
health: {health}
"""


def listed(body: dict[str, Any], url: str) -> dict[str, Any]:
    """The admin listing's entry for the prefill at ``url``."""
    (entry,) = [
        i for i in body["instances"] if i["url"] == url and i["role"] == "prefill"
    ]
    return entry


async def until(condition: Callable[[], bool], what: str) -> None:
    """Waits, bounded, for ``condition`` (a probe the proxy sent on its own)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def complete(px: RunningProxy, times: int) -> None:
    for _ in range(times):
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200, await resp.text()
        await resp.read()


@asynccontextmanager
async def proxy_that_found(
    stubs: Callable[..., Any], dns: FakeDns, tmp_path: Path
) -> AsyncIterator[tuple[RunningProxy, StubEngine, StubEngine]]:
    """A proxy (its config in a file, for reloads) with a configured prefill
    and one NAME resolves to, found by its first lookup: the proxy, the
    configured prefill and the found one."""
    configured, found, decode = await stubs(), await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"
    path.write_text(dns_config_yaml(configured.url, found.port, decode.url))
    dns.records[NAME] = ["127.0.0.1"]
    async with running_proxy(load_config(path), source=str(path)) as px:
        await px.state.discovery.refresh()
        yield px, configured, found


# ------------------------------------------------------------ admin removal


async def test_admin_removal_survives_the_next_dns_lookup(stubs, dns, tmp_path):
    async with proxy_that_found(stubs, dns, tmp_path) as (px, _, found):
        assert px.state.find(found.url, "prefill")
        status, _ = await admin(
            px, "DELETE", "/admin/instances", json={"url": found.url}
        )
        assert status == 200
        await px.state.discovery.refresh()
        assert not px.state.find(found.url, "prefill")


async def test_an_address_the_admin_api_removed_returns_when_it_adds_it_back(
    stubs, dns, tmp_path
):
    async with proxy_that_found(stubs, dns, tmp_path) as (px, _, found):
        await admin(px, "DELETE", "/admin/instances", json={"url": found.url})
        await px.state.discovery.refresh()
        status, _ = await add_prefill(px, found.url)
        assert status == 200
        await px.state.discovery.refresh()
        (back,) = px.state.find(found.url, "prefill")
        assert back.discovered_by is None  # the operator's now, never reaped by DNS


async def test_a_reload_gives_dns_back_an_address_the_admin_api_removed(
    stubs, dns, tmp_path
):
    # A reload restores the file's pools: url: entries an admin removed come
    # back too, and the file says "every address of the name".
    async with proxy_that_found(stubs, dns, tmp_path) as (px, _, found):
        await admin(px, "DELETE", "/admin/instances", json={"url": found.url})
        assert await px.state.reload()
        await px.state.discovery.refresh()
        (back,) = px.state.find(found.url, "prefill")
        assert back.discovered_by == f"{NAME}:{found.port}"


# ------------------------------------------------------------ admin drain


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
async def test_an_admin_drain_survives_the_address_leaving_dns_and_coming_back(
    stubs, dns, tmp_path, busy
):
    async with proxy_that_found(stubs, dns, tmp_path) as (px, configured, found):
        (inst,) = px.state.find(found.url, "prefill")
        await until(lambda: inst.healthy, "the found prefill probed into rotation")
        status, _ = await admin(
            px, "POST", "/admin/instances/drain", json={"url": found.url}
        )
        assert status == 200
        # Busy: a request still runs on it, so it is drained but not yet removed.
        running = 1 if busy else 0
        inst.in_flight += running
        dns.records[NAME] = []
        await px.state.discovery.refresh()
        dns.records[NAME] = ["127.0.0.1"]
        await px.state.discovery.refresh()
        inst.in_flight -= running
        (back,) = px.state.find(found.url, "prefill")
        assert (back is inst) == busy and back.drained
        await until(lambda: back.healthy, "the returned prefill probed")
        await complete(px, 3)
        assert not found.requests and len(configured.requests) == 3


async def test_an_admin_undrain_does_not_readmit_an_address_that_left_dns(
    stubs, dns, tmp_path
):
    async with proxy_that_found(stubs, dns, tmp_path) as (px, _, found):
        (inst,) = px.state.find(found.url, "prefill")
        await admin(px, "POST", "/admin/instances/drain", json={"url": found.url})
        inst.in_flight += 1  # kept, draining, until this request ends
        dns.records[NAME] = []
        await px.state.discovery.refresh()
        status, body = await admin(
            px, "POST", "/admin/instances/undrain", json={"url": found.url}
        )
        assert status == 200 and listed(body, found.url)["drained"]
        dns.records[NAME] = ["127.0.0.1"]
        await px.state.discovery.refresh()
        inst.in_flight -= 1
        assert not inst.drained


# ------------------------------------------------- probed before any traffic


async def test_a_configured_instance_down_at_startup_takes_traffic_once_a_probe_passes(
    stubs,
):
    p, d, sick = await stubs(), await stubs(), await stubs()
    sick.mode = "unhealthy"  # its /health fails; it would answer completions
    async with running_proxy(make_config([p.url, sick.url], [d.url])) as px:
        assert not px.state.find(sick.url)[0].healthy
        await complete(px, 4)
        assert not sick.requests and len(p.requests) == 4
        sick.mode = "ok"
        await px.state.health.check_all()
        await complete(px, 4)
        assert sick.requests


async def test_the_configured_instances_are_probed_before_the_proxy_listens(stubs):
    # The next round is a whole interval (an hour here) away.
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], health={"interval_s": 3600})
    async with running_proxy(config) as px:
        assert (p.health_checks, d.health_checks) == (1, 1)
        resp = await px.session.get(px.url + "/readiness")
        assert resp.status == 200
        await complete(px, 2)
        assert (p.health_checks, d.health_checks) == (1, 1)


async def test_readiness_fails_from_startup_while_no_decode_passes_a_probe(stubs):
    p, d = await stubs(), await stubs()
    d.mode = "unhealthy"
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.session.get(px.url + "/readiness")
        assert resp.status == 503
        assert "no healthy decode" in (await resp.json())["problems"][0]
        d.mode = "ok"
        await px.state.health.check_all()
        resp = await px.session.get(px.url + "/readiness")
        assert resp.status == 200


async def test_an_unreachable_configured_instance_is_never_tried(stubs):
    p, d = await stubs(), await stubs()
    down = f"http://127.0.0.1:{free_port()}"
    async with running_proxy(make_config([down, p.url], [d.url])) as px:
        await complete(px, 4)
        metrics = await px.metrics()
    assert len(p.requests) == 4
    assert "kvguard_proxy_retries_total{" not in metrics


async def test_one_passing_probe_admits_a_new_instance_whatever_healthy_threshold(
    stubs,
):
    # The threshold counts passes that bring a failed instance back.
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], health={"healthy_threshold": 3})
    async with running_proxy(config) as px:
        await complete(px, 2)
        assert len(p.requests) == 2


async def test_an_address_dns_finds_enters_on_its_first_passing_probe(
    stubs, dns, tmp_path
):
    # healthy_threshold counts passes that bring a failed instance back.
    configured, found, decode = await stubs(), await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"
    path.write_text(
        dns_config_yaml(
            configured.url,
            found.port,
            decode.url,
            health="{interval_s: 3600, healthy_threshold: 3}",
        )
    )
    dns.records[NAME] = ["127.0.0.1"]
    async with running_proxy(load_config(path), source=str(path)) as px:
        await px.state.discovery.refresh()
        (inst,) = px.state.find(found.url, "prefill")
        await until(lambda: found.health_checks == 1, "the found prefill probed")
        await until(lambda: inst.healthy, "the found prefill in rotation")
        await complete(px, 4)
        assert found.requests


async def test_without_health_checks_configured_instances_serve_unprobed(stubs):
    p, d = await stubs(), await stubs()
    p.mode = "unhealthy"
    config = make_config([p.url], [d.url], health={"enabled": False})
    async with running_proxy(config) as px:
        await complete(px, 2)
        assert len(p.requests) == 2 and p.health_checks == 0


async def test_an_instance_the_admin_api_adds_takes_traffic_once_a_probe_passes(
    stubs, monkeypatch
):
    monkeypatch.setenv("ADM", "adm")
    p, d, added = await stubs(), await stubs(), await stubs()
    added.mode = "unhealthy"  # its /health fails; it would answer completions
    config = make_config([p.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        status, body = await add_prefill(px, added.url)
        assert status == 200 and not listed(body, added.url)["healthy"]
        await complete(px, 4)
        assert not added.requests
        added.mode = "ok"
        await px.state.health.check_all()
        await complete(px, 4)
        assert added.requests


async def test_an_instance_the_admin_api_adds_is_probed_before_the_answer(
    stubs, monkeypatch
):
    # Not a whole health interval (an hour here) later: a healthy one serves at once.
    monkeypatch.setenv("ADM", "adm")
    p, d, added = await stubs(), await stubs(), await stubs()
    config = make_config(
        [p.url], [d.url], auth={"admin_key_env": "ADM"}, health={"interval_s": 3600}
    )
    async with running_proxy(config) as px:
        status, body = await add_prefill(px, added.url)
        assert status == 200 and listed(body, added.url)["healthy"]
        assert added.health_checks == 1
        await complete(px, 4)
        assert len(added.requests) == 2


async def test_instances_a_reload_adds_take_traffic_once_a_probe_passes(
    stubs, tmp_path
):
    p, d, sick, fine = await stubs(), await stubs(), await stubs(), await stubs()
    sick.mode = "unhealthy"
    path = tmp_path / "proxy.yaml"

    def write(prefills: list[str]) -> None:
        entries = "".join(f'\n        - url: "{u}"' for u in prefills)
        path.write_text(
            f"""
models:
  '*':
    prefill:
      instances:{entries}
    decode: {{instances: [{{url: "{d.url}"}}]}}
health: {{interval_s: 3600}}
"""
        )

    write([p.url])
    async with running_proxy(load_config(path), source=str(path)) as px:
        write([p.url, sick.url, fine.url])
        assert await px.state.reload()
        # Probed while the running pools still served: judged on arrival.
        assert (sick.health_checks, fine.health_checks) == (1, 1)
        assert not px.state.find(sick.url)[0].healthy
        assert px.state.find(fine.url)[0].healthy
        await complete(px, 6)
        assert not sick.requests and fine.requests and p.requests


async def test_without_health_checks_an_added_instance_enters_at_once(
    stubs, monkeypatch
):
    # Nothing would ever probe it in: it is trusted, as at startup.
    monkeypatch.setenv("ADM", "adm")
    p, d, added = await stubs(), await stubs(), await stubs()
    added.mode = "unhealthy"
    config = make_config(
        [p.url], [d.url], auth={"admin_key_env": "ADM"}, health={"enabled": False}
    )
    async with running_proxy(config) as px:
        status, body = await add_prefill(px, added.url)
        assert status == 200 and listed(body, added.url)["healthy"]
        assert added.health_checks == 0
        await complete(px, 2)
        assert added.requests
