"""The operator endpoints under any reachable state and any input.

``/metrics``, ``/status``, ``/health`` and the admin API are served by the
real app on 127.0.0.1 and fed:

- state: models named with any text the configuration takes, instances with
  odd but valid URLs (IPv6, ports, https, IDNA hosts), ``dns:`` entries and
  what they answer, weights, KV integrity failures recorded as the flow
  records them (metrics, tracker, its ejections, the last failures for
  /status), drains and removals through the admin API;
- any ``Authorization`` header (bytes, schemes, spacing, several) against
  any keys from variables and files;
- any JSON body and query string to each admin route.

Each test starts one proxy and drives its event loop by hand (``Served``):
an example then costs a few local requests, not a proxy start, and the
file runs in seconds. A proxy outliving its examples is also what
``forget_instance`` must cope with: series of instances an earlier example
had must be gone. Backends are closed ports; health checks are off and
probes answer "down" without a socket; DNS comes from a stub resolver;
the discovery and health loops are stopped, so examples run discovery
rounds themselves.
"""

from __future__ import annotations

import asyncio
import base64
import html.parser
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from proxy.config import ProxyConfig, normalize_url
from proxy.instances import Instance
from proxy.state import ProxyState
from proxy.testing import RunningProxy, running_proxy
from tests.support.dns import resolved

T = TypeVar("T")

ADMIN_KEY = "adm-key"
CLOSED = "http://127.0.0.1:9"  # nothing listens: no backend is needed
# What the configuration accepts as a weight (InstanceConfig.weight).
MAX_WEIGHT = 1e6


def _settings(examples: int) -> settings:
    """``examples`` per test: each is a few local requests (milliseconds)."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# ------------------------------------------------------------------ plumbing


class StubResolver(AbstractResolver):
    """Answers each host with the addresses an example set; none: the lookup fails."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}

    async def resolve(
        self, host: str, port: int = 0, family: int = socket.AF_INET
    ) -> list[ResolveResult]:
        found = self.records.get(host)
        if not found:
            raise OSError(f"no answer for {host}")
        return resolved(host, port, found)

    async def close(self) -> None:
        pass


@dataclass
class Reply:
    """One HTTP answer: status, headers, body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as strict JSON (no NaN or Infinity, which JSON has not)."""
        return json.loads(self.body, parse_constant=_no_constant)


def _no_constant(name: str) -> Any:
    raise AssertionError(f"not JSON: {name}")


class Served:
    """A running proxy whose loop the test drives; see the module docstring."""

    def __init__(self, config: dict[str, Any], source: Path | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._proxy = running_proxy(config, source)
        self.px: RunningProxy = self.loop.run_until_complete(self._proxy.__aenter__())
        self.resolver = StubResolver()
        self.run(self._stop_loops())

    @property
    def state(self) -> ProxyState:
        return self.px.state

    async def _stop_loops(self) -> None:
        st_ = self.state
        for task in (st_._discovery_task, st_._health_task):
            assert task is not None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        async def down(*args: Any, **kwargs: Any) -> bool:
            return False

        st_.health.probe = down  # type: ignore[method-assign]
        st_.discovery._resolver = self.resolver
        st_.discovery._resolver_config = st_.config.discovery

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro``, then the background tasks it left (probes)."""

        async def then_settle() -> T:
            result = await coro
            while tasks := list(self.state._tasks):
                await asyncio.gather(*tasks)
            return result

        return self.loop.run_until_complete(then_settle())

    def request(
        self,
        method: str,
        path: str,
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
    ) -> Reply:
        async def go() -> Reply:
            async with self.px.session.request(
                method, self.px.url + path, headers=headers, data=data
            ) as resp:
                return Reply(resp.status, dict(resp.headers), await resp.read())

        return self.run(go())

    def raw(self, path: str, header_lines: list[bytes]) -> Reply:
        """A GET of ``path`` with ``header_lines`` as sent, byte for byte."""

        async def go() -> Reply:
            port = int(self.px.url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"GET " + path.encode() + b" HTTP/1.1\r\nHost: proxy\r\n"
            head += b"".join(line + b"\r\n" for line in header_lines)
            writer.write(head + b"Connection: close\r\n\r\n")
            data = await reader.read()
            writer.close()
            return _parse_reply(data)

        return self.run(go())

    def admin(self, method: str, path: str, body: Any = None) -> Reply:
        data = None if body is None else json.dumps(body).encode()
        return self.request(
            method, path, {"Authorization": f"Bearer {ADMIN_KEY}"}, data
        )

    def listing(self) -> Any:
        reply = self.admin("GET", "/admin/instances")
        assert reply.status == 200, reply
        return reply.json()

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self._proxy.__aexit__(None, None, None))
        finally:
            self.loop.close()


def _parse_reply(data: bytes) -> Reply:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert "chunked" not in headers.get("transfer-encoding", ""), head
    return Reply(int(lines[0].split()[1]), headers, body)


@contextmanager
def serve(config: dict[str, Any], source: Path | None = None) -> Iterator[Served]:
    served = Served(config, source)
    try:
        yield served
    finally:
        served.close()


def _base(models: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A configuration with health checks off and slow loops."""
    return {
        "models": models,
        "health": {"enabled": False},
        "discovery": {"interval_s": 3600, "timeout_s": 1},
        **sections,
    }


def _pools(prefill: list[str], decode: list[str]) -> dict[str, Any]:
    return {
        "prefill": {"instances": [{"url": u} for u in prefill]},
        "decode": {"instances": [{"url": u} for u in decode]},
    }


def assert_openai_error(reply: Reply) -> None:
    """``reply`` is a 4xx in OpenAI error JSON naming its status."""
    assert 400 <= reply.status < 500, reply
    assert reply.headers.get("Content-Type", reply.headers.get("content-type", ""))
    error = reply.json()["error"]
    assert error["code"] == reply.status, reply
    assert isinstance(error["message"], str) and isinstance(error["type"], str)


# -------------------------------------------------------------- strategies

_LABELS = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True)
_IDNA = st.sampled_from(["bücher", "例え", "ÄÖÜ", "пример", "xn--bcher-kva", "Kv"])
hostnames = st.lists(_LABELS | _IDNA, min_size=1, max_size=3).map(".".join)
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
hosts = hostnames | ipv4 | ipv6.map(lambda a: f"[{a}]")
ports = st.none() | st.integers(1, 65535)
raw_urls = st.builds(
    lambda scheme, host, port, path: (
        f"{scheme}://{host}{'' if port is None else f':{port}'}{path}"
    ),
    st.sampled_from(["http", "https", "HTTP", "Https"]),
    hosts,
    ports,
    st.sampled_from(["", "/", "/base", "/a/b/", "/v2", "/a&b", "/it's", "/<x>"]),
)


def _normalized(url: str) -> str | None:
    try:
        return normalize_url(url)
    except ValueError:
        return None


# URLs the configuration takes, as written (its normalized form is the label).
urls = raw_urls.filter(lambda u: _normalized(u) is not None)
dns_names = st.builds(
    lambda host, port: f"{host}:{port}",
    hostnames | ipv4,
    st.integers(1, 65535),
)
model_names = (
    st.text(max_size=10)
    | st.sampled_from(["*", 'q"uote', "back\\slash", "new\nline", "<b>m</b>", "&amp;"])
    | st.text(alphabet="<>&\"'\\\n\r\t =", max_size=6)
)
weights = st.sampled_from([1.0, 0.5, 3.0, MAX_WEIGHT]) | st.floats(0.001, MAX_WEIGHT)
# Printable ASCII only, as the flow keeps a client's id (else its own).
request_ids = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40
).filter(bool)


def _entry_key(entry: dict[str, Any]) -> str:
    return _normalized(entry["url"]) or "" if "url" in entry else "dns:" + entry["dns"]


entries = st.one_of(
    st.builds(lambda u, w: {"url": u, "weight": w}, urls, weights),
    st.builds(lambda d, w: {"dns": d, "weight": w}, dns_names, weights),
)
pools = st.lists(entries, min_size=1, max_size=3, unique_by=_entry_key).map(
    lambda es: {"instances": es}
)
loopback = st.sampled_from(["127.0.0.2", "127.0.0.3", "::1", "127.1.2.3"])


@dataclass
class Failure:
    """A KV integrity failure of one model's prefill and decode, by index."""

    model: int
    prefill: int
    decode: int
    request_id: str
    error: str


@dataclass
class Scene:
    """One example's state: the configuration, DNS answers and events."""

    models: dict[str, dict[str, dict[str, list[dict[str, Any]]]]]
    answers: dict[str, list[str]]
    failures: list[Failure]
    drains: list[int]
    removals: list[int]


@st.composite
def scenes(draw: st.DrawFn) -> Scene:
    models = draw(
        st.dictionaries(
            model_names,
            st.fixed_dictionaries({"prefill": pools, "decode": pools}),
            min_size=1,
            max_size=3,
        )
    )
    names = {
        e["dns"]
        for m in models.values()
        for p in m.values()
        for e in p["instances"]
        if "dns" in e
    }
    answers = {
        n: draw(st.lists(loopback, max_size=2, unique=True)) for n in sorted(names)
    }
    index = st.integers(0, 20)
    failures = draw(
        st.lists(
            st.builds(
                Failure,
                index,
                index,
                index,
                request_ids,
                st.text(max_size=220),
            ),
            max_size=4,
        )
    )
    return Scene(
        models,
        answers,
        failures,
        draw(st.lists(index, max_size=2)),
        draw(st.lists(index, max_size=2)),
    )


# --------------------------------------------------- what /status shows


_PAGE_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "div",
    "span", "table", "tr", "th", "td", "br", "p", "code",
}  # fmt: skip


class Page(html.parser.HTMLParser):
    """The tags, data-* attributes and text of the status page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: set[str] = set()
        self.attrs: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        found = {k: v or "" for k, v in attrs}
        if any(k.startswith("data-") for k in found):
            self.attrs.append((tag, found))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def values(self, attr: str) -> list[str]:
        return [a[attr] for _, a in self.attrs if attr in a]


# ------------------------------------------------- the state properties


class Expected:
    """The series the recorded events should have left, kept across examples."""

    def __init__(self) -> None:
        self.integrity: Counter[tuple[str, str]] = Counter()
        self.ejections: Counter[tuple[str, str, str]] = Counter()

    def prune(self, state: ProxyState) -> None:
        """Drops what ``forget_instance`` drops: series of (role, url) no
        pool lists any more."""
        listed = {(i.role, i.url) for i in state.all_instances()}
        for p, d in list(self.integrity):
            if ("prefill", p) not in listed or ("decode", d) not in listed:
                del self.integrity[(p, d)]
        for role, url, kind in list(self.ejections):
            if (role, url) not in listed:
                del self.ejections[(role, url, kind)]


def _record_failure(
    served: Served, expected: Expected, prefill: Instance, decode: Instance, f: Failure
) -> None:
    """What ``Flow._decode_error`` and ``Flow._log`` do for a checksum mismatch."""
    state = served.state
    state.metrics.integrity_failures.labels(prefill.url, decode.url).inc()
    expected.integrity[(prefill.url, decode.url)] += 1
    for ejection in state.tracker.record_failure(prefill, decode):
        state.on_ejection(ejection)
        kind = "instance" if ejection.partner is None else "pair"
        expected.ejections[(ejection.instance.role, ejection.instance.url, kind)] += 1
    state.recent_failures.append(
        {
            "ts": round(time.time(), 3),
            "request_id": f.request_id,
            "attempt": 0,
            "attempt_id": f.request_id + "-0",
            "route": "completions",
            "model": decode.model,
            "stream": False,
            "prefill": prefill.url,
            "decode": decode.url,
            "status": 500,
            "error": f.error,
            "outcome": "kv_integrity",
            "total_ms": 1.0,
        }
    )


def _apply_scene(served: Served, expected: Expected, scene: Scene) -> None:
    """Reloads ``scene``'s configuration, runs a discovery round, then the
    failures, drains and removals."""
    state = served.state
    config = ProxyConfig.model_validate(
        _base(
            scene.models,
            auth={"admin_key_env": "KVG_PROP_ADMIN"},
            ejection={"instance_failures": 2, "pair_failures": 2, "cooldown_s": 600},
        )
    )
    state.apply(config)  # as a reload does (health off: nothing to probe first)
    served.resolver.records = {
        name.rpartition(":")[0].strip("[]"): addrs
        for name, addrs in scene.answers.items()
    }
    served.run(state.discovery.refresh())
    models = list(state.models.items())
    for f in scene.failures:
        _, pools_ = models[f.model % len(models)]
        p, d = pools_.prefill.instances, pools_.decode.instances
        if not (p and d):  # a dns: pool that found nothing yet
            continue
        _record_failure(
            served, expected, p[f.prefill % len(p)], d[f.decode % len(d)], f
        )
    for path, picks in (
        ("/admin/instances/drain", scene.drains),
        ("/admin/instances", scene.removals),
    ):
        for pick in picks:
            listed = list(state.all_instances())
            if not listed:
                break
            inst = listed[pick % len(listed)]
            method = "POST" if path.endswith("drain") else "DELETE"
            body = {"url": inst.url, "role": inst.role, "model": inst.model}
            reply = served.admin(method, path, body)
            assert reply.status in (200, 400), reply  # 400: its pool's last one
    expected.prune(state)


def _check_metrics(served: Served, expected: Expected) -> None:
    reply = served.request("GET", "/metrics")
    assert reply.status == 200, reply
    families = {
        f.name: f for f in text_string_to_metric_families(reply.body.decode("utf-8"))
    }
    state = served.state
    instances = {(i.model, i.role, i.url): i for i in state.all_instances()}
    for gauge, value in (
        ("kvguard_proxy_instance_healthy", attrgetter("healthy")),
        ("kvguard_proxy_instance_ejected", attrgetter("ejected")),
        ("kvguard_proxy_instance_drained", attrgetter("drained")),
        # Takes new requests: healthy, in service, neither drained nor ejected.
        (
            "kvguard_proxy_instance_up",
            lambda i: i.healthy and not (i.drained or i.ejected or i.removed),
        ),
    ):
        series = {
            (s.labels["model"], s.labels["role"], s.labels["instance"]): s.value
            for s in families[gauge].samples
        }
        assert len(series) == len(families[gauge].samples)
        # Label values round-trip: model names and URLs exactly as the pools have them.
        assert series == {key: float(value(inst)) for key, inst in instances.items()}
    integrity = {
        (s.labels["prefill"], s.labels["decode"]): s.value
        for s in families["kvguard_proxy_kv_integrity_failures"].samples
        if s.name.endswith("_total")
    }
    assert integrity == dict(expected.integrity)
    ejections = {
        (s.labels["role"], s.labels["instance"], s.labels["kind"]): s.value
        for s in families["kvguard_proxy_ejections"].samples
        if s.name.endswith("_total")
    }
    assert ejections == dict(expected.ejections)
    names = {e.dns for _, _, e in _dns_entries(state)}
    lookups = {
        s.labels["name"] for s in families["kvguard_proxy_discovery_lookups"].samples
    }
    assert lookups == names


def _dns_entries(state: ProxyState) -> Iterator[tuple[str, str, Any]]:
    for name, model in state.config.models.items():
        for role, pool in (("prefill", model.prefill), ("decode", model.decode)):
            for entry in pool.instances:
                if entry.dns is not None:
                    yield name, role, entry


def _check_status(served: Served) -> None:
    basic = base64.b64encode(f"ops:{ADMIN_KEY}".encode()).decode()
    reply = served.request("GET", "/status", {"Authorization": f"Basic {basic}"})
    assert reply.status == 200, reply
    page = Page()
    page.feed(reply.body.decode("utf-8"))
    page.close()
    # Every value is escaped: no tag but the page's own, and each value
    # reads back exactly from its attribute.
    assert page.tags <= _PAGE_TAGS, page.tags - _PAGE_TAGS
    state = served.state
    listed = list(state.all_instances())
    assert sorted(page.values("data-url")) == sorted(i.url for i in listed)
    assert page.values("data-model") == list(state.models)
    prefills = [i.url for p in state.models.values() for i in p.prefill.instances]
    assert page.values("data-prefill") == prefills
    text = "".join(page.text)
    for entry in state.recent_failures:
        assert entry["request_id"] in text
        assert entry["error"][:200] in text


def _check_health(served: Served) -> None:
    reply = served.request("GET", "/health")
    body = reply.json()
    assert (reply.status, body["status"]) in ((200, "ok"), (503, "unhealthy"))


@_settings(30)
@given(scene=scenes())
def _state_examples(served: Served, expected: Expected, scene: Scene) -> None:
    try:
        ProxyConfig.model_validate(_base(scene.models))
    except ValidationError:
        assume(False)
    _apply_scene(served, expected, scene)
    _check_metrics(served, expected)
    _check_status(served)
    _check_health(served)
    assert sorted(
        (i["model"], i["role"], i["url"]) for i in served.listing()["instances"]
    ) == sorted(i.key for i in served.state.all_instances())


def test_metrics_status_and_health_answer_any_reachable_state_with_values_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/metrics parses, with the pools' model names and URLs as label values
    and no series of an instance that left; /status escapes every value;
    /health and the admin listing are JSON."""
    monkeypatch.setenv("KVG_PROP_ADMIN", ADMIN_KEY)
    first = _base(
        {"m": _pools([CLOSED], [CLOSED])}, auth={"admin_key_env": "KVG_PROP_ADMIN"}
    )
    with serve(first) as served:
        _state_examples(served, Expected())


# ---------------------------------------------------------- the auth property

# Keys as a variable (comma-separated) or a file (one per line) can hold
# them: no comma, no surrounding whitespace, no control characters.
_KEY_CHARS = st.characters(
    codec="utf-8",
    exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp"),
    exclude_characters=",",
)
keys = st.text(_KEY_CHARS, min_size=1, max_size=12)


@dataclass
class KeySpec:
    """Where the keys of one kind come from: a variable and/or a file with
    comments and blank lines around them."""

    env: list[str]
    file: list[str]
    comments: list[str]

    @property
    def keys(self) -> set[str]:
        return set(self.env) | set(self.file)

    def file_text(self) -> str:
        lines = [f"# {c}" for c in self.comments] + ["", *self.file, "  "]
        return "\n".join(lines) + "\n"


def key_specs(pool: list[str]) -> st.SearchStrategy[KeySpec]:
    """One kind's keys, from ``pool``: kinds share keys, or do not."""
    subsets = st.lists(st.sampled_from(pool), max_size=3, unique=True)
    return st.builds(
        KeySpec,
        subsets,
        subsets.map(lambda ks: [k for k in ks if not k.startswith("#")]),
        subsets,
    )


@st.composite
def header_values(draw: st.DrawFn, pool: list[str]) -> bytes:
    """One ``Authorization`` value (CR and LF frame the lines, so none):
    ``Bearer`` and a key of ``pool`` as the docs write it (any case, any
    spacing), or near misses of either, Basic credentials, any bytes.

    Choices are explicit draws, so that each kind comes often."""
    key = draw(st.sampled_from(pool))
    miss = draw(st.integers(0, 5))
    if miss == 1:  # a key with more: a prefix must not do
        key += draw(st.text(_KEY_CHARS, min_size=1, max_size=2))
    elif miss == 2:
        key = key[:-1]
    elif miss == 3:
        key = draw(st.sampled_from(["x" + key, key.swapcase(), "# " + key, ""]))
    elif miss == 4:
        key = draw(st.text(max_size=8))
    lead = draw(st.sampled_from(["", " ", "\t"]))
    trail = draw(st.sampled_from(["", " ", "\t "]))
    form = draw(st.integers(0, 4))
    if form <= 1:  # as documented
        scheme = draw(st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]))
        sep = draw(st.sampled_from([" ", "  ", " \t"]))
    elif form == 2:  # another scheme, or no space after it
        scheme = draw(st.sampled_from(["Bearer:", "Token", "Basic", "Bearer\t"]))
        sep = draw(st.sampled_from(["", "\t", " "]))
    elif form == 3:
        user = draw(st.text(max_size=4))
        return b"Basic " + base64.b64encode(f"{user}:{key}".encode())
    else:
        return draw(st.binary(max_size=24)).replace(b"\r", b"").replace(b"\n", b"")
    value = lead + scheme + sep + key + trail
    return value.encode("utf-8").replace(b"\r", b"").replace(b"\n", b"")


# Bytes aiohttp's parser refuses in a field value (its own 400).
_NOT_FIELD_BYTES = set(range(0x20)) - {0x09} | {0x7F}


def _expected_token(value: bytes) -> str | None:
    """The Bearer token the documented grammar gives: ``Bearer`` (any case),
    a space, the token; whitespace around the value and the token ignored."""
    text = value.strip(b" \t").decode("utf-8", "surrogateescape")
    if text[:7].lower() != "bearer ":
        return None
    return text[7:].strip()


def _expected_password(value: bytes) -> str | None:
    """The password of a Basic value (any user name), as the status page takes it."""
    text = value.strip(b" \t").decode("utf-8", "surrogateescape")
    if text[:6].lower() != "basic ":
        return None
    try:
        decoded = base64.b64decode(text[6:].strip(), validate=True)
    except ValueError:
        return None
    return decoded.partition(b":")[2].decode("utf-8", "surrogateescape")


@dataclass
class AuthScene:
    clients: KeySpec
    admin: KeySpec
    metrics: KeySpec
    headers: list[bytes]


@st.composite
def auth_scenes(draw: st.DrawFn) -> AuthScene:
    pool = draw(st.lists(keys, min_size=1, max_size=3, unique=True))
    specs = [draw(key_specs(pool)) for _ in range(3)]
    # Mostly one header; none, or several (only the first counts), now and then.
    count = draw(st.sampled_from([1, 1, 1, 1, 2, 3, 0]))
    headers = [draw(header_values(pool)) for _ in range(count)]
    return AuthScene(*specs, headers)


def _auth_config(scene: AuthScene, tmp: Path) -> dict[str, Any]:
    """The ``auth`` section naming each kind's variable and file (those it uses)."""
    auth: dict[str, str] = {}
    for kind, spec, env_field, file_field in (
        ("clients", scene.clients, "api_keys_env", "api_keys_file"),
        ("admin", scene.admin, "admin_key_env", "admin_key_file"),
        ("metrics", scene.metrics, "metrics_key_env", "metrics_key_file"),
    ):
        if spec.env:
            var = f"KVG_PROP_{kind.upper()}"
            os.environ[var] = " , ".join(["", *spec.env, ""])
            auth[env_field] = var
        if spec.file:
            path = tmp / f"{kind}.keys"
            path.write_text(spec.file_text(), encoding="utf-8")
            auth[file_field] = str(path)
    return auth


@_settings(80)
@given(scene=auth_scenes())
def _auth_examples(served: Served, tmp: Path, scene: AuthScene) -> None:
    config = _base({"m": _pools([CLOSED], [CLOSED])}, auth=_auth_config(scene, tmp))
    served.state.apply(ProxyConfig.model_validate(config))
    lines = [b"Authorization: " + h for h in scene.headers]
    first = scene.headers[0] if scene.headers else None
    odd_bytes = any(b in _NOT_FIELD_BYTES for h in scene.headers for b in h)
    token = None if first is None else _expected_token(first)
    password = None if first is None else _expected_password(first)
    for path, spec in (
        ("/metrics", scene.metrics),
        ("/v1/models", scene.clients),
        ("/admin/instances", scene.admin),
        ("/status?refresh=0", scene.admin),
    ):
        reply = served.raw(path, lines)
        assert reply.status < 500, reply
        if reply.status == 400:
            # A header value aiohttp's parser refuses: its answer, in JSON.
            assert odd_bytes, reply
            assert_openai_error(reply)
            continue
        keys = spec.keys
        if path == "/admin/instances" and not keys:
            # No admin key configured: the admin API is off for everyone.
            assert reply.status == 403, reply
            assert_openai_error(reply)
            continue
        accepted = (
            not keys
            or token in keys
            or (path.startswith("/status") and password in keys)
        )
        if accepted:
            assert reply.status == 200, (path, reply)
        else:
            assert reply.status == 401, (path, reply)
            assert_openai_error(reply)
            assert reply.json()["error"]["type"] == "AuthenticationError"


def test_a_request_is_accepted_iff_its_first_authorization_carries_a_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each endpoint takes any of its configured keys (variable, file, or
    both; comments and blank lines are no keys) as ``Bearer`` in any case,
    /status also as a Basic password; anything else is a 401 in OpenAI JSON
    (the admin API a 403 with no admin key), never a 500."""
    for kind in ("CLIENTS", "ADMIN", "METRICS"):
        monkeypatch.setenv(f"KVG_PROP_{kind}", "unused")  # restored at the end
    with serve(_base({"m": _pools([CLOSED], [CLOSED])})) as served:
        _auth_examples(served, tmp_path)


# ----------------------------------------------------- the admin API input

ROUTES = [
    ("GET", "/admin/instances"),
    ("POST", "/admin/instances"),
    ("DELETE", "/admin/instances"),
    ("POST", "/admin/instances/drain"),
    ("POST", "/admin/instances/undrain"),
    ("POST", "/admin/reload"),
    ("PUT", "/admin/instances"),
    ("GET", "/admin/instances/drain"),
    ("POST", "/admin/nothing"),
]
ODD_MODEL = 'q"<x>\\\n'
BASE_URLS = {
    "m": (["http://127.0.0.1:9", "https://[::1]:9/base"], ["http://bücher.test:9"]),
    ODD_MODEL: (["http://127.0.0.1:9"], ["http://127.0.0.1:10"]),
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
bad_urls = st.sampled_from(
    ["", "ftp://h", "http://h/v1", "http://u:p@h", "http://[zz]", "http://h?q"]
)
_known_urls = [u for pair in BASE_URLS.values() for us in pair for u in us]
field_values = {
    "url": st.sampled_from(_known_urls) | raw_urls | json_values,
    "role": st.sampled_from(["prefill", "decode", "Prefill", ""]) | json_values,
    "model": st.sampled_from([*BASE_URLS, "*", "other"]) | json_values,
    "weight": st.sampled_from([0, -1, 1, 2.5, MAX_WEIGHT, 1e7, 1e308, 5e-324])
    | st.floats(allow_nan=False)
    | json_values,
    "api_key_env": st.sampled_from(
        ["KVGUARD_BACKEND_KEY_", "KVGUARD_BACKEND_KEY_SET", "KVGUARD_BACKEND_KEY_X\0"]
    )
    | st.text(max_size=8),
    "extra": json_values,
}


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


structured = st.fixed_dictionaries({}, optional=field_values)
bodies = st.one_of(
    st.none(),
    structured.map(_json),
    json_values.map(_json),
    st.binary(max_size=30),
)
queries = st.one_of(
    st.just(""),
    st.dictionaries(
        st.sampled_from(["url", "role", "model", "weight", "x"]),
        st.sampled_from(_known_urls) | st.text(max_size=8),
        max_size=3,
    ).map(lambda q: "?" + urlencode(q) if q else ""),
    st.text(max_size=12).map(lambda q: "?" + quote(q, safe="=&%+")),
)


@dataclass
class Call:
    method: str
    path: str
    query: str
    body: bytes | None


models_ = st.sampled_from(list(BASE_URLS))
roles = st.sampled_from(["prefill", "decode"])
# Any route, query and body; and bodies of the right shape for each route,
# so that calls get past the parsing to what they change.
calls = st.one_of(
    st.builds(
        lambda route, query, body: Call(route[0], route[1], query, body),
        st.sampled_from(ROUTES),
        queries,
        bodies,
    ),
    st.fixed_dictionaries(
        {
            "url": raw_urls | st.sampled_from(_known_urls) | bad_urls,
            "role": roles,
            "model": models_,
        },
        optional={
            "weight": st.sampled_from([1, 2.5, MAX_WEIGHT, 1e7, 1e308])
            | st.floats(min_value=0, allow_infinity=False),
            "api_key_env": field_values["api_key_env"],
        },
    ).map(lambda body: Call("POST", "/admin/instances", "", _json(body))),
    st.builds(
        lambda route, body: Call(route[0], route[1], "", _json(body)),
        st.sampled_from(ROUTES[2:5]),
        st.fixed_dictionaries(
            {"url": st.sampled_from(_known_urls) | raw_urls | bad_urls},
            optional={"role": roles, "model": models_},
        ),
    ),
)


def _weights_a_config_takes(listing: Any) -> None:
    for inst in listing["instances"]:
        assert 0 < inst["weight"] <= MAX_WEIGHT, inst


@_settings(80)
@given(sequence=st.lists(calls, min_size=1, max_size=3))
def _admin_examples(served: Served, base: ProxyConfig, sequence: list[Call]) -> None:
    served.state.apply(base)  # each example starts from the file's pools
    for call in sequence:
        before = served.listing()
        reply = served.request(
            call.method,
            call.path + call.query,
            {"Authorization": f"Bearer {ADMIN_KEY}"},
            call.body,
        )
        after = served.listing()
        assert reply.status < 500, (call, reply)
        if reply.status >= 400:
            assert_openai_error(reply)
            assert after == before, call  # a refused call changes nothing
        else:
            assert reply.json() == after
        # Whatever the admin API takes leaves pools a configuration could
        # hold: weights it takes, a prefill and a decode in every model.
        _weights_a_config_takes(after)
        held = {(i["model"], i["role"]) for i in after["instances"]}
        assert held == {(m, r) for m in BASE_URLS for r in ("prefill", "decode")}


def test_admin_calls_answer_2xx_or_an_openai_4xx_and_a_refused_one_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Any method, query and body to each admin route: never a 5xx; a 4xx in
    OpenAI JSON leaves GET /admin/instances as it was; a 2xx answers the
    listing; the pools stay ones a configuration could hold."""
    monkeypatch.setenv("KVGUARD_BACKEND_KEY_SET", "backend")
    key_file = tmp_path / "admin.key"
    key_file.write_text(f"# the admin key\n{ADMIN_KEY}\n")
    config = _base(
        {name: _pools(*pair) for name, pair in BASE_URLS.items()},
        auth={"admin_key_file": str(key_file)},
    )
    source = tmp_path / "proxy.yaml"
    source.write_text(json.dumps(config), encoding="utf-8")
    with serve(config, source) as served:
        _admin_examples(served, ProxyConfig.model_validate(config))


def test_the_admin_api_refuses_a_weight_the_configuration_refuses(
    tmp_path: Path,
) -> None:
    """Found by the property above: POST /admin/instances took any positive
    weight (1000001, 1e308), where the configuration takes at most 10^6;
    two decodes of 1e308 made power_of_two raise on every request."""
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY)
    config = _base(
        {"m": _pools([CLOSED], [CLOSED])}, auth={"admin_key_file": str(key_file)}
    )
    with serve(config) as served:
        before = served.listing()
        for weight in (1000001.0, 1e308):
            add = {"url": "http://127.0.0.1:11", "role": "decode", "weight": weight}
            reply = served.admin("POST", "/admin/instances", add)
            assert reply.status == 400, reply
            assert "weight" in reply.json()["error"]["message"]
            assert served.listing() == before
        add = {"url": "http://127.0.0.1:11", "role": "decode", "weight": MAX_WEIGHT}
        assert served.admin("POST", "/admin/instances", add).status == 200
    # The bound is the configuration's.
    entry = {"url": CLOSED, "weight": MAX_WEIGHT}
    ProxyConfig.model_validate(
        _base(
            {"m": {"prefill": {"instances": [entry]}, "decode": {"instances": [entry]}}}
        )
    )
    with pytest.raises(ValidationError):
        entry["weight"] = 1000001.0
        ProxyConfig.model_validate(
            _base(
                {
                    "m": {
                        "prefill": {"instances": [entry]},
                        "decode": {"instances": [entry]},
                    }
                }
            )
        )
