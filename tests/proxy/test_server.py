"""The proxy's edges: auth, limits, bad bodies, /health, /v1/models, admin, reload."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from proxy_helpers import StubEngine, add_prefill, admin, expected_text, make_config

import proxy.state
from proxy.config import ConfigError, ProxyConfig, load_config, parse_config
from proxy.testing import running_proxy
from tests.support.metrics import metric
from tests.support.ports import free_port

COMPLETION = {"prompt": "hi", "max_tokens": 4}


async def test_missing_or_wrong_api_key_is_401_and_the_right_one_passes(
    stubs, monkeypatch
):
    monkeypatch.setenv("TEST_KEYS", "k1,k2")
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], auth={"api_keys_env": "TEST_KEYS"})
    async with running_proxy(config) as px:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
            resp = await px.post("/v1/completions", COMPLETION, headers=headers)
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "AuthenticationError"
        resp = await px.post(
            "/v1/completions", COMPLETION, headers={"Authorization": "Bearer k2"}
        )
        assert resp.status == 200
        async with px.session.get(px.url + "/v1/models") as resp:
            assert resp.status == 401
    assert len(p.requests) == 1


async def test_keys_can_come_from_a_file(stubs, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team a\nsecret-a\n\nsecret-b\n")
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], auth={"api_keys_file": str(keys)})
    async with running_proxy(config) as px:
        ok = await px.post(
            "/v1/completions", COMPLETION, headers={"Authorization": "Bearer secret-b"}
        )
        bad = await px.post(
            "/v1/completions", COMPLETION, headers={"Authorization": "Bearer # team a"}
        )
    assert (ok.status, bad.status) == (200, 401)


async def test_backend_key_is_sent_to_backends(stubs, monkeypatch):
    monkeypatch.setenv("BACKEND_KEY", "vllm-secret")
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], auth={"backend_api_key_env": "BACKEND_KEY"})
    async with running_proxy(config) as px:
        await (await px.post("/v1/completions", COMPLETION)).read()
    for stub in (p, d):
        assert stub.requests[0][1]["Authorization"] == "Bearer vllm-secret"


async def test_malformed_body_is_400_in_openai_error_json(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        for path, body in (
            ("/v1/completions", b"{not json"),
            ("/v1/completions", b'{"max_tokens": 3}'),
            ("/v1/chat/completions", b'{"messages": "hi"}'),
        ):
            resp = await px.post(path, body)
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["type"] == "BadRequestError" and error["code"] == 400
    assert p.requests == []


async def test_oversized_body_is_413_with_or_without_content_length(stubs):
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], limits={"max_body_bytes": 2048})
    big = {"prompt": "x" * 4096}
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", big)
        assert resp.status == 413

        async def chunks():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 512
            yield b'"}'

        resp = await px.session.post(px.url + "/v1/completions", data=chunks())
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == 413
    assert p.requests == []


def _completion_of(size: int) -> bytes:
    """A completions body of exactly ``size`` bytes."""
    head, tail = b'{"max_tokens": 2, "prompt": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "chunked"])
async def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(
    stubs, sized
):
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], limits={"max_body_bytes": 2048})
    async with running_proxy(config) as px:
        for size, status in ((2048, 200), (2049, 413)):
            body = _completion_of(size)

            async def chunks(body: bytes = body) -> AsyncIterator[bytes]:
                for i in range(0, len(body), 500):
                    yield body[i : i + 500]

            resp = await px.session.post(
                px.url + "/v1/completions",
                data=body if sized else chunks(),
                headers={"Content-Type": "application/json"},
            )
            assert resp.status == status, await resp.text()
    assert len(p.requests) == 1


async def test_a_compressed_body_is_held_to_the_limit_as_it_inflates(stubs):
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], limits={"max_body_bytes": 2048})
    small = msgspec.json.encode({"prompt": "hi", "max_tokens": 4})
    bomb = msgspec.json.encode({"prompt": "x" * 100_000})
    gzip_ = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", gzip.compress(bomb), headers=gzip_)
        assert len(gzip.compress(bomb)) < 2048
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == 413
        assert p.requests == []

        resp = await px.post("/v1/completions", small, headers=gzip_)
        assert resp.status == 400  # labelled gzip, but it is not
        error = (await resp.json())["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert p.requests == []

        resp = await px.post("/v1/completions", gzip.compress(small), headers=gzip_)
        assert resp.status == 200
        assert p.requests[0][2]["prompt"] == "hi"


async def test_requests_over_the_in_flight_limit_are_429(stubs):
    p, d = await stubs(), await stubs("hang")
    config = make_config(
        [p.url], [d.url], limits={"max_in_flight": 1}, timeouts={"total_s": 2}
    )
    async with running_proxy(config) as px:
        first = asyncio.create_task(px.post("/v1/completions", COMPLETION))
        for _ in range(200):
            if d.requests:
                break
            await asyncio.sleep(0.01)
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 429
        first.cancel()


async def test_unknown_model_is_404(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url], model="m")) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "model": "other"})
        assert resp.status == 404
        resp = await px.post("/v1/completions", COMPLETION)  # no model: the only one
        assert resp.status == 200


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/nowhere", 404, None),
        ("POST", "/v1/completions/extra", 404, None),
        ("GET", "/v1/completions", 405, "POST"),
        ("PURGE", "/v1/chat/completions", 405, "POST"),
        ("POST", "/health", 405, "GET,HEAD"),
        ("PUT", "/admin/instances", 405, "DELETE,GET,HEAD,POST"),
    ],
)
async def test_an_unrouted_request_is_404_or_405_with_allow_in_openai_json(
    stubs, method, path, status, allow
):
    p, d = await stubs(), await stubs()
    async with (
        running_proxy(make_config([p.url], [d.url])) as px,
        px.session.request(method, px.url + path) as resp,
    ):
        assert resp.status == status
        assert resp.headers.get("Allow") == allow
        body = await resp.json()
    assert body["error"]["code"] == status
    assert p.requests == [] and d.requests == []


async def test_the_catch_all_route_shadows_no_route(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        for path in ("/health", "/liveness", "/v1/models", "/metrics", "/status"):
            async with px.session.get(px.url + path) as resp:
                assert resp.status == 200, path
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200


async def test_health_is_200_only_while_each_role_has_a_healthy_instance(stubs):
    p, d = await stubs(), await stubs()
    down = f"http://127.0.0.1:{free_port()}"
    config = make_config(
        [p.url, down], [d.url], health={"interval_s": 30, "unhealthy_threshold": 1}
    )

    async def statuses() -> dict[str, int]:
        got = {}
        for path in ("/health", "/readiness", "/liveness"):
            async with px.session.get(px.url + path) as resp:
                got[path] = resp.status
                if resp.status == 503:
                    assert "no healthy decode" in (await resp.json())["problems"][0]
        return got

    async with running_proxy(config) as px:
        assert await statuses() == {"/health": 200, "/readiness": 200, "/liveness": 200}
        d.mode = "unhealthy"
        await px.state.health.check_all()
        # Not ready without a decode, but alive: a restart would not bring one.
        assert await statuses() == {"/health": 503, "/readiness": 503, "/liveness": 200}
        assert not next(i for i in px.state.all_instances() if i.url == down).healthy
        d.mode = "ok"
        await px.state.health.check_all()
        assert await statuses() == {"/health": 200, "/readiness": 200, "/liveness": 200}


async def test_models_is_the_union_of_the_backends(stubs):
    a, b = await stubs(), await stubs()
    while a.port % 2 == b.port % 2:  # stubs report m0 or m1 by port parity
        b = await stubs()
    config = make_config([a.url], [b.url], model="configured")
    async with (
        running_proxy(config) as px,
        px.session.get(px.url + "/v1/models") as resp,
    ):
        ids = {m["id"] for m in (await resp.json())["data"]}
    assert ids == {"m0", "m1", "configured"}


async def test_models_keeps_a_backends_entry_and_never_lists_the_any_model(stubs):
    entry = {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}
    p, d = await stubs(served=[entry]), await stubs(served=[entry])
    for model in ("m", "*"):
        async with (
            running_proxy(make_config([p.url], [d.url], model=model)) as px,
            px.session.get(px.url + "/v1/models") as resp,
        ):
            assert (await resp.json())["data"] == [entry], model


async def test_metrics_expose_the_documented_families(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        await (await px.post("/v1/completions", {**COMPLETION, "stream": True})).read()
        text = await px.metrics()
    for family in (
        'kvguard_proxy_requests_total{outcome="ok",route="completions"} 1.0',
        "kvguard_proxy_ttft_seconds_bucket",
        "kvguard_proxy_inter_token_seconds_bucket",
        "kvguard_proxy_e2e_seconds_bucket",
        'kvguard_proxy_leg_seconds_bucket{le="0.005",leg="prefill"}',
        "kvguard_proxy_in_flight 0.0",
        f'kvguard_proxy_instance_healthy{{instance="{p.url}",model="*",'
        'role="prefill"} 1.0',
    ):
        assert family in text


@pytest.mark.parametrize("client", ["stream", "as-stream", "whole"])
async def test_each_leg_and_the_first_token_are_timed_within_the_request(stubs, client):
    p, d = await stubs(prefill_delay=0.2), await stubs(chunk_delay=0.01)
    config = make_config(
        [p.url], [d.url], retry={"non_stream_as_stream": client != "whole"}
    )
    async with running_proxy(config) as px:
        started = time.monotonic()
        resp = await px.post(
            "/v1/completions", {**COMPLETION, "stream": client == "stream"}
        )
        assert resp.status == 200
        await resp.read()
        elapsed = time.monotonic() - started
        text = await px.metrics()
    prefill = metric(text, "kvguard_proxy_leg_seconds_sum", leg="prefill")
    decode = metric(text, "kvguard_proxy_leg_seconds_sum", leg="decode")
    ttft = metric(text, "kvguard_proxy_ttft_seconds_sum")
    e2e = metric(text, "kvguard_proxy_e2e_seconds_sum")
    gaps = metric(text, "kvguard_proxy_inter_token_seconds_sum")
    assert prefill >= 0.2 and decode > 0
    assert prefill + decode <= ttft <= e2e <= elapsed
    assert 0 <= gaps <= e2e - ttft  # between chunks relayed after the first
    if client == "stream":
        assert metric(text, "kvguard_proxy_inter_token_seconds_count") >= 1
    for leg in ("prefill", "decode"):
        assert metric(text, "kvguard_proxy_leg_seconds_count", leg=leg) == 1


async def test_admin_api_requires_its_key(stubs, monkeypatch):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        assert (await admin(px, "GET", "/admin/instances"))[0] == 403  # not configured
    monkeypatch.setenv("ADM", "adm")
    async with running_proxy(
        make_config([p.url], [d.url], auth={"admin_key_env": "ADM"})
    ) as px:
        assert (await admin(px, "GET", "/admin/instances", key=None))[0] == 401
        assert (await admin(px, "GET", "/admin/instances", key="wrong"))[0] == 401
        status, body = await admin(px, "GET", "/admin/instances")
        assert status == 200 and {i["url"] for i in body["instances"]} == {p.url, d.url}


async def test_admin_drain_add_remove_steer_new_requests(stubs, monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    p1, p2, d = await stubs(), await stubs(), await stubs()
    config = make_config([p1.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        status, _ = await add_prefill(px, p2.url)
        assert status == 200
        status, _ = await admin(
            px, "POST", "/admin/instances/drain", json={"url": p1.url}
        )
        assert status == 200
        for _ in range(3):
            assert (await px.post("/v1/completions", COMPLETION)).status == 200
        assert (len(p1.requests), len(p2.requests)) == (0, 3)
        await admin(px, "POST", "/admin/instances/undrain", json={"url": p1.url})
        status, body = await admin(
            px, "DELETE", "/admin/instances", json={"url": p2.url}
        )
        assert status == 200 and p2.url not in {i["url"] for i in body["instances"]}
        for _ in range(2):
            assert (await px.post("/v1/completions", COMPLETION)).status == 200
        assert (len(p1.requests), len(p2.requests)) == (2, 3)
        status, body = await admin(
            px, "DELETE", "/admin/instances", json={"url": p1.url}
        )
        assert status == 400 and "last prefill" in body["error"]["message"]
        status, body = await admin(
            px, "POST", "/admin/instances", json={"role": "x", "url": "y"}
        )
        assert status == 400


async def test_an_admin_call_naming_a_model_touches_that_models_instance_only(
    stubs, monkeypatch
):
    monkeypatch.setenv("ADM", "adm")
    p, d = await stubs(), await stubs()
    pools = {
        "prefill": {"instances": [{"url": p.url}]},
        "decode": {"instances": [{"url": d.url}]},
    }
    config = {
        "models": {"a": pools, "b": pools},
        "health": {"interval_s": 30},
        "auth": {"admin_key_env": "ADM"},
    }
    async with running_proxy(config) as px:
        body = {"url": p.url, "role": "prefill", "model": "a"}
        status, _ = await admin(px, "POST", "/admin/instances/drain", json=body)
        assert status == 200
        drained = {(i.model, i.url) for i in px.state.all_instances() if i.drained}
    assert drained == {("a", p.url)}


async def test_an_admin_call_takes_its_query_only_without_a_body(stubs, monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    p1, p2, d = await stubs(), await stubs(), await stubs()
    config = make_config([p1.url, p2.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        path = "/admin/instances/drain"
        status, _ = await admin(px, "POST", path, params={"url": p1.url})
        assert status == 200
        status, _ = await admin(
            px, "POST", path, params={"url": p1.url}, json={"url": p2.url}
        )
        assert status == 200
        drained = {i.url for i in px.state.all_instances() if i.drained}
    assert drained == {p1.url, p2.url}


async def test_an_instance_added_with_weight_zero_is_refused(stubs, monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    p1, p2, d = await stubs(), await stubs(), await stubs()
    config = make_config([p1.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        spec = {"role": "prefill", "url": p2.url, "weight": 0}
        status, body = await admin(px, "POST", "/admin/instances", json=spec)
        assert status == 400 and "weight must be > 0" in body["error"]["message"]
        assert p2.url not in {i.url for i in px.state.all_instances()}


async def test_a_reload_without_a_file_changes_nothing(stubs, monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        assert await px.state.reload() is False
        status, body = await admin(px, "POST", "/admin/reload")
        assert status == 409 and "without --config" in body["error"]["message"]


async def test_a_reload_keeps_the_listening_address_and_says_so(
    stubs, tmp_path, caplog
):
    p, d = await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"
    models = f"models:\n  m: {{prefill: {{instances: [{{url: '{p.url}'}}]}}, "
    models += f"decode: {{instances: [{{url: '{d.url}'}}]}}}}\n"
    path.write_text(models)
    async with running_proxy(load_config(path), source=str(path)) as px:
        server = px.state.config.server
        assert await px.state.reload()
        assert "need a restart" not in caplog.text
        path.write_text(models + f"server: {{port: {server.port + 1}}}\n")
        assert await px.state.reload()
        assert px.state.config.server == server
    assert "server.host/port changes need a restart; ignored on reload" in caplog.text


async def test_a_stopped_proxy_has_closed_its_backend_connections(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        assert (await px.post("/v1/completions", COMPLETION)).status == 200
        session = px.state.session
        assert not session.closed
    assert session.closed


async def test_an_instance_failing_its_first_probe_is_named_and_stop_ends_the_loops(
    stubs, caplog
):
    p, d = await stubs(), await stubs("unhealthy")
    config = make_config([p.url], [d.url], health={"interval_s": 0.02})
    async with running_proxy(config) as px:
        # The first probes run before the proxy listens.
        assert not px.state.pools_for(None).decode.instances[0].healthy
    assert f"decode {d.url} failed its first health probe" in caplog.text
    assert f"prefill {p.url} failed" not in caplog.text
    loops = {"Health.run", "Discovery.run"}
    left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ in loops]
    assert not [t for t in left if not t.done()]


async def test_reload_adds_and_removes_instances_under_load_without_failures(
    stubs, tmp_path
):
    p1, p2, d = await stubs(), await stubs(), await stubs()
    for stub in (p1, p2, d):
        stub.chunk_delay = 0.01
    path = tmp_path / "proxy.yaml"

    def write(prefills):
        lines = ["models:", "  '*':", "    prefill:", "      instances:"]
        lines += [f"        - url: {u}" for u in prefills]
        lines += ["    decode:", "      instances:", f"        - url: {d.url}"]
        path.write_text("\n".join(lines) + "\n")

    write([p1.url])
    from proxy.config import load_config

    async with running_proxy(load_config(path), source=str(path)) as px:
        stop = asyncio.Event()
        statuses: list[tuple[int, str]] = []

        async def client(i: int) -> None:
            while not stop.is_set():
                resp = await px.post(
                    "/v1/completions",
                    {"prompt": f"p{i}", "max_tokens": 5, "stream": i % 2 == 0},
                )
                body = await resp.read()
                statuses.append((resp.status, body.decode()))

        clients = [asyncio.create_task(client(i)) for i in range(6)]
        await asyncio.sleep(0.3)
        write([p2.url])  # p2 added, p1 removed, requests in flight on p1
        assert await px.state.reload()
        await asyncio.sleep(0.15)  # prefills picked before the reload reach p1
        seen_p1 = len(p1.requests)
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*clients)
    assert statuses and all(s == 200 for s, _ in statuses)
    assert all("error" not in body for _, body in statuses)
    assert len(p1.requests) == seen_p1 and p2.requests  # traffic moved over


async def test_a_bad_reload_keeps_the_running_configuration(stubs, tmp_path):
    p, d = await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"
    path.write_text("models: {}\n")
    async with running_proxy(make_config([p.url], [d.url]), source=str(path)) as px:
        assert not await px.state.reload()
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200
        text = (await resp.json())["choices"][0]["text"]
    assert text == expected_text("hi", 4)


async def test_a_failed_reload_changes_no_instance(stubs, tmp_path, monkeypatch):
    monkeypatch.delenv("KVGUARD_TEST_UNSET_KEY", raising=False)
    p, d = await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"

    def write(weight: int, extra: str = "") -> None:
        path.write_text(
            f"""
models:
  '*':
    prefill:
      instances:
        - {{url: "{p.url}", weight: {weight}}}{extra}
    decode: {{instances: [{{url: "{d.url}"}}]}}
"""
        )

    write(1)
    async with running_proxy(load_config(path), source=str(path)) as px:
        (inst,) = px.state.find(p.url)
        # A new weight, then an entry whose key cannot be read: refused whole.
        write(
            7,
            '\n        - {url: "http://127.0.0.1:9", api_key_env: '
            "KVGUARD_TEST_UNSET_KEY}",
        )
        assert not await px.state.reload()
        assert inst.weight == 1 and px.state.find(p.url) == [inst]
        assert not px.state.find("http://127.0.0.1:9")


async def test_reloads_apply_in_the_order_they_were_asked(stubs, tmp_path, monkeypatch):
    p, d = await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"

    def write(weight: int) -> None:
        path.write_text(
            f"models: {{'*': {{prefill: {{instances: [{{url: '{p.url}', "
            f"weight: {weight}}}]}}, decode: {{instances: [{{url: '{d.url}'}}]}}}}}}\n"
        )

    read, release = threading.Event(), threading.Event()

    def slow_first_read(source: str) -> ProxyConfig:
        config = load_config(source)
        if not read.is_set():
            read.set()
            release.wait(5)  # the second reload reads the newer file meanwhile
        return config

    write(1)
    async with running_proxy(load_config(path), source=str(path)) as px:
        monkeypatch.setattr(proxy.state, "load_config", slow_first_read)
        write(2)
        first = asyncio.create_task(px.state.reload())
        await asyncio.to_thread(read.wait, 5)
        write(3)
        second = asyncio.create_task(px.state.reload())
        await asyncio.sleep(0.2)
        release.set()
        assert await first and await second
        assert px.state.find(p.url)[0].weight == 3


async def test_turning_health_checks_off_readmits_instances_probes_took_out(
    stubs, tmp_path
):
    p, d = await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"

    def write(enabled: bool) -> None:
        path.write_text(
            f"""
models:
  '*':
    prefill: {{instances: [{{url: "{p.url}"}}]}}
    decode: {{instances: [{{url: "{d.url}"}}]}}
health: {{enabled: {str(enabled).lower()}, interval_s: 3600}}
"""
        )

    write(True)
    async with running_proxy(load_config(path), source=str(path)) as px:
        p.mode = "unhealthy"  # its /health fails; completions still work
        for _ in range(2):
            await px.state.health.check_all()
        assert not px.state.find(p.url)[0].healthy
        write(False)  # the operator turns the misbehaving checks off
        assert await px.state.reload()
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200, await resp.text()


async def test_a_probe_passed_before_the_instance_failed_does_not_readmit_it(stubs):
    p, d, slow = await stubs(), await stubs(), await stubs()
    config = make_config(
        [p.url, slow.url], [d.url], health={"interval_s": 3600, "timeout_s": 2.0}
    )

    async def answered(stub: StubEngine, checks: int) -> None:
        for _ in range(500):
            if stub.health_checks >= checks:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # and the answer has reached the proxy

    async with running_proxy(config) as px:
        await answered(slow, 1)  # the round run at startup is over
        (inst,) = px.state.find(p.url)
        slow.health_delay = 1.0  # the next round waits for this probe
        round_ = asyncio.create_task(px.state.health.check_all())
        await answered(p, 2)
        # Then p dies: two requests fail on it, and it is taken out.
        px.state.health.note(inst, ok=False)
        px.state.health.note(inst, ok=False)
        assert not inst.healthy
        await round_
        assert not inst.healthy


def test_a_health_path_must_be_an_absolute_path():
    for path in ("health", "", "http://elsewhere/health"):
        with pytest.raises(ConfigError, match=r"health\.path"):
            parse_config(
                "models: {m: {prefill: {instances: [{url: 'http://p:1'}]}, "
                f"decode: {{instances: [{{url: 'http://d:1'}}]}}}}}}\n"
                f"health: {{path: '{path}'}}\n",
                "x.yaml",
            )


async def test_ejected_instance_is_probed_back_after_its_cooldown(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        inst = next(i for i in px.state.all_instances() if i.url == p.url)
        inst.ejected_until = time.monotonic() + 60
        await px.state.health.check_all()
        assert inst.ejected  # still cooling down: a passing probe is not enough
        inst.ejected_until = time.monotonic() - 1
        p.mode = "unhealthy"
        await px.state.health.check_all()
        assert inst.ejected  # cooldown over, but the probe failed
        p.mode = "ok"
        await px.state.health.check_all()
        assert not inst.ejected and inst.healthy


async def test_metrics_can_be_put_behind_a_key(stubs, monkeypatch):
    monkeypatch.setenv("SCRAPE_KEY", "prom")
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], auth={"metrics_key_env": "SCRAPE_KEY"})
    async with running_proxy(config) as px:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            async with px.session.get(px.url + "/metrics", headers=headers) as resp:
                assert resp.status == 401
                body = await resp.json()
                assert body["error"]["type"] == "AuthenticationError"
                assert p.url not in await resp.text()
        async with px.session.get(
            px.url + "/metrics", headers={"Authorization": "Bearer prom"}
        ) as resp:
            assert resp.status == 200
            assert p.url in await resp.text()


async def test_admin_api_reads_only_backend_key_variables(stubs, monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    monkeypatch.setenv("KVGUARD_BACKEND_KEY_P2", "p2-secret")
    p1, p2, d = await stubs(), await stubs(), await stubs()
    config = make_config([p1.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        for name in ("ADM", "HOME", "PATH", "KVGUARD_BACKEND_KEY_"):
            status, body = await admin(
                px,
                "POST",
                "/admin/instances",
                json={"role": "prefill", "url": p2.url, "api_key_env": name},
            )
            assert status == 400, name
            assert "KVGUARD_BACKEND_KEY_" in body["error"]["message"]
        status, _ = await admin(
            px,
            "POST",
            "/admin/instances",
            json={
                "role": "prefill",
                "url": p2.url,
                "api_key_env": "KVGUARD_BACKEND_KEY_P2",
            },
        )
        assert status == 200
        await admin(px, "POST", "/admin/instances/drain", json={"url": p1.url})
        assert (await px.post("/v1/completions", COMPLETION)).status == 200
    assert p2.requests[0][1]["Authorization"] == "Bearer p2-secret"
