"""The proxy in front of real fake engines (fake_engine.testing): issue 4's list.

Each test starts its engines in-process on free ports; a monolithic engine
(prefill and decode in one) gives the reference answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from proxy_helpers import body, make_config, read_sse, text_of

pytest.importorskip("torch")

from fake_engine.config import FaultConfig, FaultKind, FaultSide, Role
from fake_engine.testing import EngineSpec, fake_engines
from proxy.testing import RunningProxy, running_proxy
from tests.support.metrics import fetch_metric, metric
from tests.support.shapes import shape, sse_data

PRODUCER = EngineSpec(role=Role.PRODUCER)
# Decodes fail loads whose checksums mismatch (KVGuard's fail-closed mode).
CONSUMER = EngineSpec(role=Role.CONSUMER, fail_closed=True)
MONOLITH = EngineSpec(role=Role.BOTH)
CORRUPTING = FaultConfig(fault=FaultKind.BITFLIP, side=FaultSide.PRODUCER, rate=1.0)
PROMPTS = [f"Request {i}: tell me about block {i * 7} of the cache" for i in range(20)]


async def answer(
    session: aiohttp.ClientSession, url: str, route: str, payload: dict[str, Any]
) -> tuple[int, str, list[Any]]:
    """(status, text, error events) of one request, stream or not."""
    async with session.post(url + route, json=payload) as resp:
        if payload.get("stream") and resp.status == 200:
            text, errors = await read_sse(resp)
            return resp.status, text, errors
        reply = await resp.json()
        if resp.status != 200:
            return resp.status, "", [reply.get("error")]
        return resp.status, text_of(route, reply), []


async def references(
    session: aiohttp.ClientSession, mono: str, route: str = "/v1/completions"
) -> dict[str, str]:
    out = {}
    for prompt in PROMPTS:
        status, text, _ = await answer(session, mono, route, body(route, prompt, False))
        assert status == 200
        out[prompt] = text
    return out


async def test_text_through_the_proxy_equals_a_monolithic_engine():
    async with (
        fake_engines(PRODUCER, CONSUMER, MONOLITH) as (p, d, mono),
        running_proxy(make_config([p], [d])) as px,
        aiohttp.ClientSession() as s,
    ):
        for route in ("/v1/completions", "/v1/chat/completions"):
            for prompt in PROMPTS[:3]:
                _, want, _ = await answer(
                    s, mono, route, body(route, prompt, False, 12)
                )
                assert want
                for stream in (False, True):
                    got = await answer(
                        s, px.url, route, body(route, prompt, stream, 12)
                    )
                    assert got == (200, want, []), (route, stream)
        verified = await fetch_metric(s, d, "kvguard_kv_checksum_verified_total")
    assert verified >= 12  # every answer came through a checked KV load


async def test_client_kv_transfer_params_are_ignored():
    evil = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1}
    async with (
        fake_engines(PRODUCER, CONSUMER, MONOLITH) as (p, d, mono),
        running_proxy(make_config([p], [d])) as px,
        aiohttp.ClientSession() as s,
    ):
        route = "/v1/completions"
        _, want, _ = await answer(s, mono, route, body(route, PROMPTS[0], False))
        got = await answer(
            s,
            px.url,
            route,
            {**body(route, PROMPTS[0], False), "kv_transfer_params": evil},
        )
    assert got == (200, want, [])


async def run_load(
    px_url: str, refs: dict[str, str], count: int, concurrency: int
) -> list[tuple[int, bool, list[Any]]]:
    """``count`` requests, half streamed; (status, answer correct, errors) each."""
    route = "/v1/completions"
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    results: list[tuple[int, bool, list[Any]]] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            prompt = PROMPTS[i % len(PROMPTS)]
            status, text, errors = await answer(
                session, px_url, route, body(route, prompt, i % 2 == 1)
            )
            results.append((status, text == refs[prompt], errors))

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return results


@asynccontextmanager
async def a_corrupting_prefill_beside_a_good_one(
    **ejection: Any,
) -> AsyncIterator[tuple[str, str, str, RunningProxy]]:
    """(corrupting prefill, decode, monolith, proxy): the proxy in front of
    a prefill that corrupts every KV it sends, a good one, and a decode."""
    bad_spec = EngineSpec(role=Role.PRODUCER, fault=CORRUPTING)
    async with fake_engines(bad_spec, PRODUCER, CONSUMER, MONOLITH) as (
        bad,
        good,
        d,
        mono,
    ):
        config = make_config(
            [bad, good], [d], ejection=ejection, retry={"backoff_base_s": 0.001}
        )
        async with running_proxy(config) as px:
            yield bad, d, mono, px


async def test_faulty_prefill_beside_a_good_one_every_answer_correct_and_ejected():
    concurrency, threshold = 8, 3
    async with (
        a_corrupting_prefill_beside_a_good_one(
            instance_failures=threshold, cooldown_s=300
        ) as (bad, d, mono, px),
        aiohttp.ClientSession() as s,
    ):
        refs = await references(s, mono)
        results = await run_load(px.url, refs, 200, concurrency)
        metrics = await px.metrics()
        held = await fetch_metric(s, bad, "kvguard_kv_blocks_held")
    assert len(results) == 200
    assert all(r == (200, True, []) for r in results)
    failures = metric(metrics, "kvguard_proxy_kv_integrity_failures_total", prefill=bad)
    assert threshold <= failures <= threshold + concurrency
    assert (
        metric(metrics, "kvguard_proxy_ejections_total", instance=bad, kind="instance")
        == 1
    )
    assert metric(metrics, "kvguard_proxy_instance_ejected", instance=bad) == 1
    assert metric(metrics, "kvguard_proxy_ejections_total", instance=d) == 0
    assert held == 0  # the KV of failed loads was freed, not left to its lease


async def test_corrupted_load_of_a_chat_stream_is_retried_on_another_prefill():
    # A chat stream opens with a role-only chunk before the decode's verdict.
    route = "/v1/chat/completions"
    async with (
        a_corrupting_prefill_beside_a_good_one(instance_failures=100) as (
            bad,
            _,
            mono,
            px,
        ),
        aiohttp.ClientSession() as s,
    ):
        refs = await references(s, mono, route)
        for prompt in PROMPTS[:4]:  # round robin: two start on the bad one
            reply = await answer(s, px.url, route, body(route, prompt, True))
            assert reply == (200, refs[prompt], [])
        metrics = await px.metrics()
    failures = metric(metrics, "kvguard_proxy_kv_integrity_failures_total", prefill=bad)
    assert failures >= 1


async def test_faulty_decode_among_two_every_answer_correct_and_ejected():
    concurrency, threshold = 8, 3
    bad_spec = EngineSpec(
        role=Role.CONSUMER,
        fail_closed=True,
        fault=FaultConfig(fault=FaultKind.ZERO, side=FaultSide.CONSUMER, rate=1.0),
    )
    async with fake_engines(PRODUCER, bad_spec, CONSUMER, MONOLITH) as (
        p,
        bad,
        good,
        mono,
    ):
        config = make_config(
            [p],
            [bad, good],
            ejection={"instance_failures": threshold, "cooldown_s": 300},
            retry={"backoff_base_s": 0.001},
        )
        async with running_proxy(config) as px, aiohttp.ClientSession() as s:
            refs = await references(s, mono)
            results = await run_load(px.url, refs, 200, concurrency)
            metrics = await px.metrics()
    assert all(r == (200, True, []) for r in results) and len(results) == 200
    failures = metric(metrics, "kvguard_proxy_kv_integrity_failures_total", decode=bad)
    assert threshold <= failures <= threshold + concurrency
    assert (
        metric(metrics, "kvguard_proxy_ejections_total", instance=bad, kind="instance")
        == 1
    )
    # The pair (p, bad) may be ejected too when its fifth failure comes first;
    # that is no blame on p.
    assert (
        metric(metrics, "kvguard_proxy_ejections_total", instance=p, kind="instance")
        == 0
    )


async def test_decode_killed_mid_stream_ends_the_stream_with_an_error_event():
    slow = EngineSpec(role=Role.CONSUMER, decode_tokens_per_s=20)
    idle = 2.0
    async with fake_engines(PRODUCER, slow) as urls:
        p, d = urls
        config = make_config([p], [d], timeouts={"stream_idle_s": idle})
        async with running_proxy(config) as px:
            resp = await px.post(
                "/v1/completions", body("/v1/completions", PROMPTS[0], True, 200)
            )
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: {")
            killed = time.monotonic()
            await urls.stop(1)
            rest = await asyncio.wait_for(resp.read(), idle + 3)
            elapsed = time.monotonic() - killed
    events = [e for e in rest.split(b"\n\n") if e.startswith(b"data: {")]
    assert b"error" in events[-1]
    assert msgspec.json.decode(events[-1][6:])["error"]["message"]
    assert rest.rstrip().endswith(b"data: [DONE]")
    assert elapsed < idle + 1


async def test_decode_down_before_start_is_retried_elsewhere():
    async with fake_engines(PRODUCER, CONSUMER, CONSUMER, MONOLITH) as urls:
        p, d_dead, d_ok, mono = urls
        await urls.stop(1)
        # Health checks off: on, the startup probe would keep it out of rotation.
        config = make_config(
            [p],
            [d_dead, d_ok],
            retry={"backoff_base_s": 0.001},
            health={"enabled": False},
        )
        async with running_proxy(config) as px, aiohttp.ClientSession() as s:
            refs = await references(s, mono)
            results = await run_load(px.url, refs, 10, 2)
            metrics = await px.metrics()
    assert all(r == (200, True, []) for r in results)
    assert metric(metrics, "kvguard_proxy_retries_total", reason="decode_connect") >= 1


async def test_every_prefill_down_gives_503_within_the_connect_timeout():
    async with fake_engines(PRODUCER, PRODUCER, CONSUMER) as urls:
        p1, p2, d = urls
        await urls.stop(0)
        await urls.stop(1)
        config = make_config(
            [p1, p2], [d], timeouts={"connect_s": 1.0}, health={"enabled": False}
        )
        async with running_proxy(config) as px:
            started = time.monotonic()
            resp = await px.post(
                "/v1/completions", body("/v1/completions", "hi", False)
            )
            elapsed = time.monotonic() - started
            error = (await resp.json())["error"]
    assert resp.status == 503 and error["code"] == 503 and "prefill" in error["message"]
    assert elapsed < 1.0


async def test_client_disconnect_mid_stream_aborts_the_decode_and_frees_prefill_kv():
    slow = EngineSpec(role=Role.CONSUMER, decode_tokens_per_s=20)
    async with (
        fake_engines(PRODUCER, slow) as (p, d),
        running_proxy(make_config([p], [d])) as px,
        aiohttp.ClientSession() as s,
    ):
        async with aiohttp.ClientSession() as client:
            resp = await client.post(
                px.url + "/v1/completions",
                json=body("/v1/completions", PROMPTS[1], True, 200),
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()  # the client goes away mid-stream
        aborted = held = None
        for _ in range(60):
            await asyncio.sleep(0.05)
            aborted = await fetch_metric(s, d, "kvguard_requests_aborted_total")
            held = await fetch_metric(s, p, "kvguard_kv_blocks_held")
            if aborted >= 1 and held == 0:
                break
        running = await fetch_metric(s, d, "vllm:num_requests_running")
    assert aborted is not None and aborted >= 1
    assert held == 0
    assert running == 0


async def test_client_disconnect_before_the_first_token_frees_the_prefill_kv():
    # The prefill's side of the pull hangs: it holds the KV when the client leaves.
    stuck = EngineSpec(
        role=Role.PRODUCER,
        fault=FaultConfig(fault=FaultKind.HANG, side=FaultSide.PRODUCER, rate=1.0),
    )
    async with (
        fake_engines(stuck, CONSUMER) as (p, d),
        running_proxy(make_config([p], [d])) as px,
        aiohttp.ClientSession() as s,
    ):
        async with aiohttp.ClientSession() as client:
            task = asyncio.create_task(
                client.post(
                    px.url + "/v1/completions",
                    json=body("/v1/completions", PROMPTS[2], True),
                )
            )
            for _ in range(100):
                await asyncio.sleep(0.02)
                if await fetch_metric(s, p, "kvguard_kv_blocks_held") > 0:
                    break
            assert await fetch_metric(s, p, "kvguard_kv_blocks_held") > 0
            task.cancel()
        held = None
        for _ in range(60):
            await asyncio.sleep(0.05)
            held = await fetch_metric(s, p, "kvguard_kv_blocks_held")
            if held == 0:
                break
    assert held == 0


async def test_bad_requests_and_keys_are_refused_before_any_engine_work(monkeypatch):
    monkeypatch.setenv("PROXY_KEYS", "good-key")
    async with (
        fake_engines(PRODUCER, CONSUMER) as (p, d),
        running_proxy(
            make_config(
                [p],
                [d],
                auth={"api_keys_env": "PROXY_KEYS"},
                limits={"max_body_bytes": 4096},
            )
        ) as px,
        aiohttp.ClientSession() as s,
    ):
        ok = {"Authorization": "Bearer good-key"}
        cases = [
            (b"{bad json", ok, 400),
            (msgspec.json.encode({"prompt": "x" * 8000}), ok, 413),
            (msgspec.json.encode({"prompt": "hi"}), {}, 401),
            (
                msgspec.json.encode({"prompt": "hi"}),
                {"Authorization": "Bearer bad"},
                401,
            ),
            # Refused by the decode alone: the proxy refuses them before the
            # prefill, past the decode's max_model_len read from /v1/models.
            (msgspec.json.encode({"prompt": "hi", "max_tokens": 10**6}), ok, 400),
            (
                msgspec.json.encode(
                    {"prompt": "hi", "stream_options": {"include_usage": True}}
                ),
                ok,
                400,
            ),
            # vLLM would answer 500 (and the proxy try another prefill).
            (msgspec.json.encode({"prompt": "hi", "structured_outputs": []}), ok, 400),
        ]
        for data, headers, status in cases:
            resp = await px.post("/v1/completions", data, headers=headers)
            assert resp.status == status
            assert (await resp.json())["error"]["code"] == status
        sent = await fetch_metric(s, p, "kvguard_kv_checksum_sent_total")
        resp = await px.post(
            "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=ok
        )
        assert resp.status == 200
    assert sent == 0


async def test_reload_adds_and_removes_an_instance_under_load_without_failures(
    tmp_path,
):
    from proxy.config import load_config

    async with fake_engines(PRODUCER, PRODUCER, CONSUMER, MONOLITH) as (
        p1,
        p2,
        d,
        mono,
    ):
        path = tmp_path / "proxy.yaml"
        template = (
            "models:\n  '*':\n    prefill: {{instances: [{prefills}]}}\n"
            "    decode: {{instances: [{{url: {d}}}]}}\n"
        )
        path.write_text(template.format(prefills=f"{{url: {p1}}}", d=d))
        async with (
            running_proxy(load_config(path), source=str(path)) as px,
            aiohttp.ClientSession() as s,
        ):
            refs = await references(s, mono)
            load = asyncio.create_task(run_load(px.url, refs, 150, 6))
            await asyncio.sleep(0.2)
            path.write_text(template.format(prefills=f"{{url: {p2}}}", d=d))
            assert await px.state.reload()  # what SIGHUP runs
            results = await load
            sent_p2 = await fetch_metric(s, p2, "kvguard_kv_checksum_sent_total")
    assert len(results) == 150 and all(r == (200, True, []) for r in results)
    assert sent_p2 > 0


async def test_hung_kv_load_of_a_non_stream_request_is_retried_like_a_streams():
    # The decode's first pull hangs (a stuck NIXL read); the proxy gives up
    # after decode_first_token_s, as for a stream, and retries.
    hangs_once = EngineSpec(
        role=Role.CONSUMER,
        fail_closed=True,
        fault=FaultConfig(fault=FaultKind.HANG, side=FaultSide.CONSUMER, count=1),
    )
    async with fake_engines(PRODUCER, hangs_once, MONOLITH) as (p, d, mono):
        config = make_config(
            [p],
            [d],
            timeouts={"decode_first_token_s": 1.0, "total_s": 20},
            retry={"backoff_base_s": 0.001},
        )
        async with running_proxy(config) as px, aiohttp.ClientSession() as s:
            for route in ("/v1/completions", "/v1/chat/completions"):
                payload = body(route, PROMPTS[3], False)
                _, want, _ = await answer(s, mono, route, payload)
                started = time.monotonic()
                got = await answer(s, px.url, route, payload)
                waited = time.monotonic() - started
                assert got == (200, want, [])
                assert waited < 10, waited
            metrics = await px.metrics()
    assert metric(metrics, "kvguard_proxy_retries_total", reason="decode_timeout") == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"return_token_ids": True},
        {"echo": True},
        {"echo": True, "return_token_ids": True},
    ],
    ids=["token-ids", "echo", "echo-token-ids"],
)
async def test_assembled_non_stream_reply_matches_the_engines_own(fields):
    async with (
        fake_engines(PRODUCER, CONSUMER, MONOLITH) as (p, d, mono),
        running_proxy(make_config([p], [d])) as px,
        aiohttp.ClientSession() as s,
    ):
        for route in ("/v1/completions", "/v1/chat/completions"):
            if route != "/v1/completions" and "echo" in fields:
                continue  # a chat echo wants prompt logprobs: not assembled
            payload = {
                # 40 tokens: the decode's chunks of 16 (non_stream_interval)
                # after the first, joined.
                **body(route, PROMPTS[4], False, 40),
                **fields,
                "stop": ["zz"],
            }
            async with s.post(mono + route, json=payload) as resp:
                want = await resp.json()
            async with s.post(px.url + route, json=payload) as resp:
                assert resp.status == 200
                got = await resp.json()
            assert want["usage"]["completion_tokens"] > 17  # three chunks or more
            # The keys of the engine's own JSON reply, null ones included.
            assert shape(got) == shape(want)
            assert got["object"] == want["object"]
            assert got["model"] == want["model"]
            assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert (
                got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
            )
            (g,), (w,) = got["choices"], want["choices"]
            for key in ("index", "finish_reason", "stop_reason", "token_ids"):
                assert g[key] == w[key], key
            if route == "/v1/completions":
                assert g["text"] == w["text"]
                assert g["prompt_token_ids"] == w["prompt_token_ids"]
            else:
                assert g["message"]["role"] == w["message"]["role"]
                assert g["message"]["content"] == w["message"]["content"]


@pytest.mark.parametrize("faulty", ["decode", "prefill"])
async def test_faulty_instance_alone_on_its_side_is_ejected_and_its_partners_are_not(
    faulty,
):
    # One decode that corrupts half its loads beside two prefills, or one
    # prefill whose KV is corrupt half the time beside two decodes: blame
    # follows the pattern across partners.
    half = 0.5
    if faulty == "decode":
        bad = EngineSpec(
            role=Role.CONSUMER,
            fail_closed=True,
            fault=FaultConfig(fault=FaultKind.ZERO, side=FaultSide.CONSUMER, rate=half),
        )
        specs = (PRODUCER, PRODUCER, bad, MONOLITH)
    else:
        bad = EngineSpec(
            role=Role.PRODUCER,
            fault=FaultConfig(
                fault=FaultKind.BITFLIP, side=FaultSide.PRODUCER, rate=half
            ),
        )
        specs = (bad, CONSUMER, CONSUMER, MONOLITH)
    async with fake_engines(*specs) as urls:
        mono = urls[3]
        prefills, decodes = (
            (urls[:2], urls[2:3])
            if faulty == "decode"
            else (
                urls[:1],
                urls[1:3],
            )
        )
        bad_url = urls[2] if faulty == "decode" else urls[0]
        config = make_config(
            prefills,
            decodes,
            ejection={"instance_failures": 3, "pair_failures": 1000, "cooldown_s": 300},
            retry={
                "backoff_base_s": 0.001,
                "max_attempts": 4,
                "on_exhausted": "decode_only",
            },
        )
        async with running_proxy(config) as px, aiohttp.ClientSession() as s:
            refs = await references(s, mono)
            results = await run_load(px.url, refs, 60, 8)
            metrics = await px.metrics()
    assert len(results) == 60 and all(r == (200, True, []) for r in results)
    ejected = {
        url
        for url in urls[:3]
        if metric(metrics, "kvguard_proxy_ejections_total", instance=url)
    }
    assert ejected == {bad_url}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("/v1/completions", {"n": 2, "temperature": 0.8}),
        ("/v1/completions", {"prompt": PROMPTS[:2]}),
        ("/v1/chat/completions", {"n": 2, "temperature": 0.8}),
    ],
    ids=["choices", "prompts", "chat-choices"],
)
async def test_choices_and_prompts_through_the_proxy_equal_a_monolithic_engine(
    route: str, fields: dict[str, Any], stream: bool
):
    # The proxy runs these on a decode alone (its prefill's KV could be
    # pulled once): the decode's answer comes back as it is.
    payload = {**body(route, PROMPTS[3], stream, 6), **fields}
    alone, through, sent = await alone_and_through_the_proxy(route, payload)
    want = _choice_texts(alone, stream)
    assert _choice_texts(through, stream) == want
    assert len(set(want.values())) == 2 and all(want.values())
    assert sent == 0  # no prefill ran


async def alone_and_through_the_proxy(
    route: str, payload: dict[str, Any]
) -> tuple[bytes, bytes, float]:
    """A monolithic engine's answer to ``payload``, the proxy's in front of
    a prefill and a decode, and the checksums that prefill sent."""
    async with (
        fake_engines(PRODUCER, CONSUMER, MONOLITH) as (p, d, mono),
        running_proxy(make_config([p], [d])) as px,
        aiohttp.ClientSession() as s,
    ):
        answers = []
        for url in (mono, px.url):
            async with s.post(url + route, json=payload) as resp:
                assert resp.status == 200
                answers.append(await resp.read())
        sent = await fetch_metric(s, p, "kvguard_kv_checksum_sent_total")
    return answers[0], answers[1], sent


def _choice_texts(raw: bytes, stream: bool) -> dict[int, str]:
    """Each choice's text, by index, of a whole answer or a stream."""
    if not stream:
        return {
            c["index"]: c["text"] if "text" in c else c["message"]["content"]
            for c in msgspec.json.decode(raw)["choices"]
        }
    texts: dict[int, str] = {}
    for event in raw.decode().split("\n\n"):
        data = event.removeprefix("data: ")
        if not data or data == "[DONE]":
            continue
        for c in msgspec.json.decode(data)["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content", "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("/v1/completions", {"logprobs": 2}),
        ("/v1/completions", {"logprobs": 1, "echo": True}),
        ("/v1/completions", {"prompt_logprobs": 1}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"prompt_logprobs": 2}),
    ],
    ids=["logprobs", "echo-logprobs", "prompt-logprobs", "chat", "chat-prompt"],
)
async def test_logprobs_through_the_proxy_equal_a_monolithic_engines(
    route: str, fields: dict[str, Any]
):
    # A whole answer is assembled from the decode's stream (or, for prompt
    # logprobs, which vLLM does not stream, asked for whole).
    payload = {**body(route, PROMPTS[5], False, 20), **fields}
    want, got = map(
        msgspec.json.decode, (await alone_and_through_the_proxy(route, payload))[:2]
    )
    for key in ("logprobs", "prompt_logprobs"):
        assert got["choices"][0].get(key) == want["choices"][0].get(key), key
    assert got.get("prompt_logprobs") == want.get("prompt_logprobs")
    assert want["choices"][0]["logprobs"] or want["choices"][0].get(
        "prompt_logprobs", want.get("prompt_logprobs")
    )


@pytest.mark.parametrize(
    ("route", "stream"),
    [
        ("/v1/completions", False),
        ("/v1/chat/completions", False),
        ("/v1/chat/completions", True),
    ],
    ids=["completions", "chat", "chat-stream"],
)
async def test_a_beam_search_through_the_proxy_equals_a_monolithic_engines(
    route: str, stream: bool
):
    # vLLM runs a beam search's steps without the prefill's params: the
    # proxy runs it on a decode alone.
    payload = {**body(route, PROMPTS[4], stream, 5), "use_beam_search": True, "n": 2}
    alone, through, sent = await alone_and_through_the_proxy(route, payload)
    want = _choice_texts(alone, stream)
    assert _choice_texts(through, stream) == want
    assert len(set(want.values())) == 2
    assert sent == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("fields", [{}, {"logprobs": 1}], ids=["text", "logprobs"])
async def test_an_echo_without_generation_through_the_proxy_equals_a_monolithic_engine(
    fields: dict[str, Any], stream: bool
):
    # vLLM answers echo with max_tokens 0 with the prompt alone (it samples
    # one token and drops it). The proxy takes it as vLLM does: prefilled
    # and loaded, or, with logprobs (which are the prompt's), run on the
    # decode alone.
    payload = {
        **body("/v1/completions", PROMPTS[6], stream),
        "echo": True,
        "max_tokens": 0,
        **fields,
    }
    alone, through, sent = await alone_and_through_the_proxy("/v1/completions", payload)
    want, got = (
        [msgspec.json.decode(e) for e in sse_data(raw.decode()) if e != "[DONE]"]
        if stream
        else [msgspec.json.decode(raw)]
        for raw in (alone, through)
    )
    assert [e["choices"] for e in got] == [e["choices"] for e in want]
    assert [e.get("usage") for e in got] == [e.get("usage") for e in want]
    assert _choice_texts(alone, stream) == {0: PROMPTS[6]}
    assert sent == (0 if fields else 1)
