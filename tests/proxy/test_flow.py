"""The request flow against stub P/D backends (no torch): shaping, relaying, retries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from proxy_helpers import StubEngine, admin, expected_text, make_config, read_sse

from proxy.body import PREFILL_KV_PARAMS
from proxy.config import ProxyConfig
from proxy.policy import prefix_hash
from proxy.protocol import INTEGRITY_MARKER
from proxy.testing import running_proxy
from tests.support.metrics import metric
from tests.support.ports import free_port, unanswered_port

COMPLETION = {
    "model": "m",
    "prompt": "hello world",
    "max_tokens": 6,
    "temperature": 0.5,
}


async def test_non_stream_completion_is_the_decode_reply(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200
        body = await resp.json()
    assert body["choices"][0]["text"] == expected_text("hello world", 6)
    assert p.aborts == d.aborts == []  # the decode pulled the KV: nothing to free


async def test_stream_completion_relays_every_token(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text, errors = await read_sse(resp)
    assert errors == []
    assert text == expected_text("hello world", 6)
    assert p.aborts == d.aborts == []


async def test_prefill_body_follows_the_wire_protocol_and_keeps_other_fields(stubs):
    p, d = await stubs(), await stubs()
    client = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "temperature": 0.25,
        "vendor_extension": {"a": [1, 2]},
    }
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/chat/completions", client)
        await resp.read()
    (sent,) = p.bodies()
    assert sent == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.25,
        "vendor_extension": {"a": [1, 2]},
        "kv_transfer_params": PREFILL_KV_PARAMS,
    }


async def test_decode_gets_the_original_body_plus_the_prefills_params_verbatim(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        await (await px.post("/v1/completions", {**COMPLETION, "stream": True})).read()
    (sent,) = d.bodies()
    kvp = sent.pop("kv_transfer_params")
    assert sent == {**COMPLETION, "stream": True}
    assert kvp["kv_checksums"] == "AAEC"
    assert kvp["future_field"] == {"x": 1}  # unknown keys kept
    assert kvp["remote_port"] == p.port


async def test_client_kv_transfer_params_never_reach_a_backend(stubs):
    p, d = await stubs(), await stubs()
    evil = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_port": 666}
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post(
            "/v1/completions", {**COMPLETION, "kv_transfer_params": evil}
        )
        assert resp.status == 200
    assert p.bodies()[0]["kv_transfer_params"] == PREFILL_KV_PARAMS
    assert d.bodies()[0]["kv_transfer_params"]["remote_host"] == "127.0.0.1"


async def test_client_kv_transfer_params_in_vllm_xargs_never_reach_a_backend(stubs):
    # vLLM takes them from vllm_xargs when the body has none at the top: so
    # on the decode-only fallback, which splices none, they would be used.
    p, d = await stubs("error500"), await stubs()
    config = make_config(
        [p.url], [d.url], retry={"max_attempts": 1, "on_exhausted": "decode_only"}
    )
    xargs = {"kv_transfer_params": "do_remote_prefill", "other": 1}
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "vllm_xargs": xargs})
        assert resp.status == 200, await resp.text()
    bodies = p.bodies() + d.bodies()
    assert len(bodies) == 2 and "kv_transfer_params" not in d.bodies()[0]
    assert all(body["vllm_xargs"] == {"other": 1} for body in bodies)


async def test_a_backends_cookies_never_reach_another_request(stubs):
    # Backends by name: aiohttp's default cookie jar keeps the cookies of
    # named hosts (not of IP addresses) and sends them on later requests.
    p = await stubs(set_cookie="route=p1; Path=/")
    d = await stubs(set_cookie="route=d1; Path=/")

    def named(url: str) -> str:
        return url.replace("127.0.0.1", "localhost")

    async with running_proxy(make_config([named(p.url)], [named(d.url)])) as px:
        for stream in (False, True):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert resp.status == 200
            await resp.read()
    assert len(p.requests) == len(d.requests) == 2
    assert [h.get("Cookie") for _, h, _ in p.requests + d.requests] == [None] * 4


async def test_backends_get_the_proxys_request_id_and_the_client_its_own(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        for _ in range(2):
            resp = await px.post(
                "/v1/completions", COMPLETION, headers={"X-Request-Id": "abc-1"}
            )
            assert resp.headers["X-Request-Id"] == "abc-1"
        resp = await px.post("/v1/completions", COMPLETION)
        generated = resp.headers["X-Request-Id"]
    sent = [h["X-Request-Id"] for _, h, _ in p.requests]
    assert sent == [h["X-Request-Id"] for _, h, _ in d.requests]
    # Each request has its own 32-hex id on both legs, whatever the client sent;
    # a request without an id of its own gets that one back.
    assert len(set(sent)) == 3 and "abc-1" not in sent
    assert all(len(rid) == 32 and int(rid, 16) >= 0 for rid in sent)
    assert sent[2] == generated


async def test_a_client_cannot_abort_another_clients_request_by_its_id(stubs):
    p, d = await stubs(), await stubs(chunk_delay=0.1)
    async with running_proxy(make_config([p.url], [d.url])) as px:
        async with aiohttp.ClientSession() as client:

            async def stream(request_id: str) -> aiohttp.ClientResponse:
                return await client.post(
                    px.url + "/v1/completions",
                    data=msgspec.json.encode(
                        {**COMPLETION, "stream": True, "max_tokens": 10}
                    ),
                    headers={"X-Request-Id": request_id},
                )

            victim = await stream("victim")  # headers come with the first token
            (victim_id,) = {h["X-Request-Id"] for _, h, _ in d.requests}
            # The other client names the victim's backend id, then leaves.
            attacker = await stream(victim_id)
            await attacker.content.readany()
            attacker.close()
            text, errors = await read_sse(victim)
        for _ in range(50):
            await asyncio.sleep(0.05)
            if d.aborts:
                break
    assert text == expected_text("hello world", 10) and errors == []
    attacker_id = d.requests[-1][1]["X-Request-Id"]
    assert attacker_id != victim_id
    assert d.aborts == [[attacker_id]]


async def until(condition: Callable[[], object]) -> None:
    """Waits up to 5 s for ``condition``: aborts go out in the background."""
    for _ in range(250):
        if condition():
            return
        await asyncio.sleep(0.02)


async def test_a_non_stream_client_leaving_mid_decode_aborts_the_decode(stubs):
    p, d = await stubs(), await stubs(chunk_delay=0.2)
    async with running_proxy(make_config([p.url], [d.url])) as px:
        with pytest.raises(TimeoutError):
            await px.post(
                "/v1/completions",
                {"prompt": "hi", "max_tokens": 20},
                timeout=aiohttp.ClientTimeout(total=0.5),
            )
        await until(lambda: d.aborts)
    assert d.aborts == [[d.requests[0][1]["X-Request-Id"]]]


async def test_a_stream_given_up_as_idle_aborts_the_decode(stubs):
    p, d = await stubs(), await stubs(chunk_delay=2.0)
    config = make_config([p.url], [d.url], timeouts={"stream_idle_s": 0.3})
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        _, errors = await read_sse(resp)
        assert "idle" in str(errors)
        await until(lambda: d.aborts)
    assert d.aborts == [[d.requests[0][1]["X-Request-Id"]]]


async def test_a_prefill_past_its_timeout_is_aborted(stubs):
    p, d = await stubs(prefill_delay=2.0), await stubs()
    config = make_config(
        [p.url], [d.url], timeouts={"prefill_s": 0.3}, retry={"max_attempts": 1}
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 503
        await until(lambda: p.aborts)
    assert p.aborts == [[p.requests[0][1]["X-Request-Id"]]]


async def test_a_client_leaving_during_the_prefill_aborts_it(stubs):
    p, d = await stubs(prefill_delay=2.0), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        with pytest.raises(TimeoutError):
            await px.post(
                "/v1/completions",
                {**COMPLETION, "stream": True},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
        await until(lambda: p.aborts)
    assert p.aborts == [[p.requests[0][1]["X-Request-Id"]]]
    assert d.requests == []


async def test_corrupted_load_is_retried_on_another_prefill_with_attempt_suffix(stubs):
    bad, good, d = await stubs("corrupt"), await stubs(), await stubs()
    config = make_config([bad.url, good.url], [d.url], retry={"backoff_base_s": 0})
    async with running_proxy(config) as px:
        for i, stream in enumerate((False, True, False, True)):
            resp = await px.post(
                "/v1/completions",
                {**COMPLETION, "stream": stream},
                headers={"X-Request-Id": f"r{i}"},
            )
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == f"r{i}"
            if stream:
                text, errors = await read_sse(resp)
                assert errors == []
            else:
                text = (await resp.json())["choices"][0]["text"]
            assert text == expected_text("hello world", 6)
        metrics = await px.metrics()
    hit_bad = [h["X-Request-Id"] for _, h, _ in bad.requests]
    assert hit_bad  # round robin sent some first attempts to the corrupting prefill
    retried = f'kvguard_proxy_retries_total{{reason="kv_integrity"}} {len(hit_bad)}.0'
    assert retried in metrics
    assert f'prefill="{bad.url}"' in metrics
    decode_ids = [h["X-Request-Id"] for _, h, _ in d.requests]
    assert all(f"{rid}-retry1" in decode_ids for rid in hit_bad)
    await asyncio.sleep(0.1)
    assert bad.held == set()  # the failed attempts' KV was freed
    assert [hit_bad[0], f"internal-{hit_bad[0]}"] in bad.aborts


async def test_decode_error_event_before_first_token_is_retried(stubs):
    p, d_bad, d_good = await stubs(), await stubs("integrity"), await stubs()
    config = make_config([p.url], [d_bad.url, d_good.url], retry={"backoff_base_s": 0})
    async with running_proxy(config) as px:
        for _ in range(4):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
            text, errors = await read_sse(resp)
            assert (resp.status, errors, text) == (
                200,
                [],
                expected_text("hello world", 6),
            )


# A decode's error event that is no integrity failure (vLLM's for a failed step).
ERROR_EVENT = b'{"error": {"message": "step failed", "type": "x", "code": 500}}'


@pytest.mark.parametrize(
    ("bad", "reason", "message"),
    [
        ({"mode": "error500"}, "decode_5xx", "HTTP 500: engine dead"),
        ({"events": [ERROR_EVENT]}, "decode_error_event", "error event: step failed"),
    ],
    ids=["5xx", "error-event"],
)
async def test_a_decode_failure_is_retried_and_reported_under_its_reason(
    stubs, bad, reason, message
):
    d_bad = await stubs(**bad)
    metrics = await _retried_past(stubs, d_bad, stream=True)
    assert metric(metrics, "kvguard_proxy_retries_total", reason=reason) == 1
    p = await stubs()
    one_decode = make_config([p.url], [d_bad.url], retry={"max_attempts": 1})
    async with running_proxy(one_decode) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 503
        assert message in (await resp.json())["error"]["message"]


async def test_decodes_failing_in_different_ways_do_not_fail_the_request_fast(
    stubs,
):
    # Only the same failure on two instances says the request is at fault.
    p, d_5xx = await stubs(), await stubs("error500")
    d_event, d_good = await stubs(events=[ERROR_EVENT]), await stubs()
    config = make_config(
        [p.url], [d_5xx.url, d_event.url, d_good.url], retry={"backoff_base_s": 0}
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)  # round robin: in order
        assert resp.status == 200, await resp.text()
    assert [len(d.requests) for d in (d_5xx, d_event, d_good)] == [1, 1, 1]


@pytest.mark.parametrize(
    ("mode", "reason"), [("empty", "decode_empty"), ("abort", "decode_aborted")]
)
async def test_empty_or_aborted_decode_stream_is_retried_elsewhere(stubs, mode, reason):
    p, d_bad, d_good = await stubs(), await stubs(mode), await stubs()
    config = make_config([p.url], [d_bad.url, d_good.url], retry={"backoff_base_s": 0})
    async with running_proxy(config) as px:
        for _ in range(2):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
            text, errors = await read_sse(resp)
            assert (errors, text) == ([], expected_text("hello world", 6))
        metrics = await px.metrics()
    assert f'kvguard_proxy_retries_total{{reason="{reason}"}} 1.0' in metrics


async def test_first_token_timeout_is_retried(stubs):
    p, d_hang, d_good = await stubs(), await stubs("hang"), await stubs()
    config = make_config(
        [p.url],
        [d_hang.url, d_good.url],
        retry={"backoff_base_s": 0},
        timeouts={"decode_first_token_s": 0.3},
    )
    async with running_proxy(config) as px:
        for _ in range(2):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
            text, errors = await read_sse(resp)
            assert (errors, text) == ([], expected_text("hello world", 6))
    await asyncio.sleep(0.1)
    assert len(d_hang.aborts) == len(d_hang.requests) >= 1  # each stuck attempt aborted
    assert d_hang.cancelled == len(d_hang.requests)


@pytest.mark.parametrize(
    ("mode", "message"),
    [("die", "decode stream broke"), ("cut", "decode stream ended without [DONE]")],
)
async def test_decode_killed_or_cut_mid_stream_ends_the_stream_with_an_error_event(
    stubs, mode, message
):
    p, d = await stubs(), await stubs(mode)
    async with running_proxy(make_config([p.url], [d.url])) as px:
        started = time.monotonic()
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        assert resp.status == 200
        text, errors = await read_sse(resp)
    assert time.monotonic() - started < 5
    assert text == expected_text("hello world", 6)[: len(text)] and text
    assert len(errors) == 1 and errors[0]["code"] == 502
    assert errors[0]["message"].startswith(message)
    assert len(d.requests) == 1  # nothing retried after the first byte


async def test_decode_abort_split_across_reads_ends_the_stream_with_an_error_event(
    stubs,
):
    p, d = await stubs(), await stubs("abort_late")
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        assert resp.status == 200
        text, errors = await read_sse(resp)
        metrics = await px.metrics()
    assert text == expected_text("hello world", 6)[: len(text)] and text
    assert len(errors) == 1 and "aborted" in errors[0]["message"]
    assert 'reason="stream_broken"' in metrics


async def test_idle_decode_stream_ends_with_an_error_event_within_the_idle_timeout(
    stubs,
):
    p, d = await stubs(), await stubs(chunk_delay=5)
    config = make_config([p.url], [d.url], timeouts={"stream_idle_s": 0.3})
    async with running_proxy(config) as px:
        started = time.monotonic()
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        text, errors = await read_sse(resp)
        elapsed = time.monotonic() - started
    assert elapsed < 2
    assert text and "idle" in errors[0]["message"]


@pytest.mark.parametrize("whole_reply", [False, True], ids=["as-stream", "whole"])
async def test_decode_down_before_start_is_retried_on_another_decode(
    stubs, whole_reply
):
    p, d = await stubs(), await stubs()
    down = f"http://127.0.0.1:{free_port()}"
    # Health checks off: on, the startup probe would keep it out of rotation.
    config = make_config(
        [p.url],
        [down, d.url],
        retry={"backoff_base_s": 0, "non_stream_as_stream": not whole_reply},
        health={"enabled": False},
    )
    async with running_proxy(config) as px:
        for stream in (False, True, False, True):
            resp = await px.post("/v1/completions", {**COMPLETION, "stream": stream})
            assert resp.status == 200
            await resp.read()
        metrics = await px.metrics()
    retried = metric(metrics, "kvguard_proxy_retries_total", reason="decode_connect")
    assert retried >= 1
    assert metric(metrics, "kvguard_proxy_retries_total") == retried


@pytest.mark.parametrize("whole_reply", [False, True], ids=["as-stream", "whole"])
async def test_a_decode_taking_no_connections_is_retried_after_the_connect_timeout(
    stubs, whole_reply
):
    p, d = await stubs(), await stubs()
    with unanswered_port() as port:
        config = make_config(
            [p.url],
            [f"http://127.0.0.1:{port}", d.url],  # round robin: it comes first
            retry={"backoff_base_s": 0, "non_stream_as_stream": not whole_reply},
            timeouts={"connect_s": 0.2},
            health={"enabled": False},
        )
        async with running_proxy(config) as px:
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200, await resp.text()
            metrics = await px.metrics()
    assert metric(metrics, "kvguard_proxy_retries_total", reason="decode_connect") == 1
    assert len(d.requests) == 1


async def test_every_prefill_down_gives_503_within_the_connect_timeout(stubs):
    d = await stubs()
    downs = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = make_config(
        downs, [d.url], timeouts={"connect_s": 1.0}, health={"enabled": False}
    )
    async with running_proxy(config) as px:
        started = time.monotonic()
        resp = await px.post("/v1/completions", COMPLETION)
        elapsed = time.monotonic() - started
        body = await resp.json()
    assert resp.status == 503
    assert elapsed < 1.0
    assert body["error"]["type"] == "ServiceUnavailableError"
    assert "prefill" in body["error"]["message"]
    assert d.requests == []


@pytest.mark.parametrize("status", [300, 302, 500, 503])
async def test_a_prefill_answering_a_3xx_or_5xx_is_retried_on_another(stubs, status):
    bad = await stubs("error500", error_status=status)
    good, d = await stubs(), await stubs()
    config = make_config([bad.url, good.url], [d.url], retry={"backoff_base_s": 0})
    async with running_proxy(config) as px:
        for _ in range(2):  # round robin: one of them starts on ``bad``
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200, await resp.text()
        metrics = await px.metrics()
    assert metric(metrics, "kvguard_proxy_retries_total", reason="prefill_5xx") == 1
    assert all("kv_transfer_params" in body for body in d.bodies())


async def test_backend_4xx_goes_back_unchanged_and_is_not_retried(stubs):
    p_bad, p_ok, d = await stubs("bad400"), await stubs(), await stubs()
    async with running_proxy(make_config([p_bad.url, p_ok.url], [d.url])) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        body = await resp.json()
    assert resp.status == 400
    assert body["error"]["message"] == "bad prompt"
    assert len(p_bad.requests) + len(p_ok.requests) == 1
    assert d.requests == []


async def test_decode_4xx_goes_back_unchanged_and_frees_the_prefill_kv(stubs):
    p, d = await stubs(), await stubs("bad400")
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "stream": True})
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "bad prompt"
    await asyncio.sleep(0.1)
    assert p.held == set()


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_4xx_attempt_is_logged_as_its_legs(stubs, caplog, leg):
    p = await stubs("bad400" if leg == "prefill" else "ok")
    d = await stubs("bad400" if leg == "decode" else "ok")
    caplog.set_level("INFO", logger="kvguard.proxy.attempts")
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 400
    (record,) = [
        msgspec.json.decode(r.getMessage())
        for r in caplog.records
        if r.name == "kvguard.proxy.attempts"
    ]
    assert (record["outcome"], record["status"]) == (f"{leg}_4xx", 400)


@pytest.mark.parametrize("pool", ["prefill", "decode"])
async def test_a_prefix_hash_pool_sends_each_prompt_where_its_prefix_hashes(
    stubs, pool
):
    # The other pool round-robins: only the hashed one needs the prefix.
    hashed = [await stubs(), await stubs()]
    other = await stubs()
    policies = {"prefill": "round_robin", "decode": "round_robin", pool: "prefix_hash"}
    urls = {"prefill": [other.url], "decode": [other.url]}
    urls[pool] = [stub.url for stub in hashed]
    config = ProxyConfig.model_validate(
        {
            "models": {
                "*": {
                    role: {
                        "policy": policies[role],
                        "instances": [{"url": url} for url in urls[role]],
                    }
                    for role in ("prefill", "decode")
                }
            },
            "health": {"interval_s": 30},
        }
    )
    async with running_proxy(config) as px:
        instances = getattr(px.state.pools_for("m"), pool).instances
        for i in range(6):
            prompt = f"prompt {i}"
            target = prefix_hash(instances, prompt.encode()).url
            for _ in range(2):  # sent twice: it lands on the same one
                before = [len(stub.requests) for stub in hashed]
                resp = await px.post(
                    "/v1/completions", {"prompt": prompt, "max_tokens": 2}
                )
                assert resp.status == 200, await resp.text()
                (got,) = [
                    stub.url
                    for stub, n in zip(hashed, before, strict=True)
                    if len(stub.requests) > n
                ]
                assert got == target


@pytest.mark.parametrize("internal", [None, ""], ids=["absent", "empty"])
async def test_a_prefill_whose_params_name_no_request_is_freed_by_its_legs_id(
    stubs, internal
):
    params: dict[str, Any] = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
    if internal is not None:
        params["remote_request_id"] = internal
    reply = {"choices": [{"index": 0, "text": " x"}], "kv_transfer_params": params}
    p = await stubs(prefill_reply=msgspec.json.encode(reply))
    d = await stubs("bad400")
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 400
        await asyncio.sleep(0.1)
    assert p.aborts == [[p.requests[0][1]["X-Request-Id"]]]


# Values vLLM refuses whatever the prompt, in fields the prefill leg does
# not carry: a decode would refuse them after the prefill had run.
REFUSED_BY_THE_DECODE = {
    "stream-options-without-stream": {"stream_options": {"include_usage": True}},
    "no-output": {"max_tokens": 0},
    "min-above-max": {"max_tokens": 2, "min_tokens": 3},
    "max-tokens-not-a-number": {"max_tokens": "six"},
}


@pytest.mark.parametrize(
    "fields", REFUSED_BY_THE_DECODE.values(), ids=REFUSED_BY_THE_DECODE.keys()
)
async def test_a_request_its_decode_would_refuse_is_refused_before_its_prefill(
    stubs, fields
):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, **fields})
        error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == 400
    assert error["param"] in fields
    assert not p.requests and not d.requests


def context(length: int) -> list[dict[str, Any]]:
    """A vLLM /v1/models listing of model "m" served with this context length."""
    return [{"id": "m", "object": "model", "max_model_len": length}]


async def test_a_budget_past_every_decodes_context_is_refused_before_its_prefill(
    stubs,
):
    p = await stubs()
    short, long = await stubs(served=context(64)), await stubs(served=context(128))
    async with running_proxy(make_config([p.url], [short.url, long.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "max_tokens": 129})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "max_tokens"
        assert error["message"] == (
            "max_tokens=129 cannot be greater than max_model_len=128. "
            "Please request fewer output tokens."
        )
        assert not p.requests
        chat = {**CHAT, "model": "m", "max_completion_tokens": 200}
        resp = await px.post("/v1/chat/completions", chat)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "max_completion_tokens"
        assert not p.requests
        resp = await px.post("/v1/completions", {**COMPLETION, "max_tokens": 128})
        assert resp.status == 200
        await resp.read()
    assert len(p.requests) == 1


async def test_a_budget_only_some_decodes_hold_goes_to_those_decodes(stubs):
    p = await stubs()
    short, long = await stubs(served=context(64)), await stubs(served=context(128))
    async with running_proxy(make_config([p.url], [short.url, long.url])) as px:
        for max_tokens in [100] * 4 + [50] * 4:
            body = {**COMPLETION, "max_tokens": max_tokens}
            resp = await px.post("/v1/completions", body)
            assert resp.status == 200
            await resp.read()
    assert [b["max_tokens"] for b in short.bodies()] == [50] * 2
    assert [b["max_tokens"] for b in long.bodies()] == [100] * 4 + [50] * 2


async def test_the_admin_api_shows_each_decodes_context_length(stubs, monkeypatch):
    monkeypatch.setenv("ADM", "adm")
    p, d = await stubs(served=context(64)), await stubs(served=context(64))
    config = make_config([p.url], [d.url], auth={"admin_key_env": "ADM"})
    async with running_proxy(config) as px:
        status, body = await admin(px, "GET", "/admin/instances")
    assert status == 200
    lens = {i["role"]: i["max_model_len"] for i in body["instances"]}
    # A prefill's is not read: its leg asks for one token.
    assert lens == {"prefill": {}, "decode": {"m": 64}}


async def test_a_decode_that_does_not_say_its_context_length_leaves_the_budget_to_it(
    stubs,
):
    p, says, silent = await stubs(), await stubs(served=context(64)), await stubs()
    async with running_proxy(make_config([p.url], [says.url, silent.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "max_tokens": 1000})
        assert resp.status == 200
        await resp.read()
    assert len(p.requests) == 1


async def test_a_decodes_context_length_is_read_again_by_each_health_check(stubs):
    p, d = await stubs(), await stubs(served=context(64))
    config = make_config([p.url], [d.url], health={"interval_s": 0.05})
    async with running_proxy(config) as px:
        body = {**COMPLETION, "max_tokens": 100}
        assert (await px.post("/v1/completions", body)).status == 400
        d.served = context(256)  # restarted with a longer context
        for _ in range(100):
            await asyncio.sleep(0.05)
            resp = await px.post("/v1/completions", body)
            await resp.read()
            if resp.status == 200:
                break
        assert resp.status == 200


async def test_exhausted_retries_fail_with_503_saying_why(stubs):
    p, d = await stubs("corrupt"), await stubs()
    config = make_config(
        [p.url], [d.url], retry={"max_attempts": 2, "backoff_base_s": 0}
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        body = await resp.json()
    assert resp.status == 503
    assert INTEGRITY_MARKER in body["error"]["message"]
    assert len(d.requests) == 2


async def test_exhausted_retries_fall_back_to_decode_only_when_configured(stubs):
    p, d = await stubs("corrupt"), await stubs()
    config = make_config(
        [p.url],
        [d.url],
        retry={"max_attempts": 2, "backoff_base_s": 0, "on_exhausted": "decode_only"},
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == expected_text(
            "hello world", 6
        )
        metrics = await px.metrics()
    assert "kv_transfer_params" not in d.bodies()[-1]
    # The second attempt and the fallback each retried the integrity failure.
    assert metric(metrics, "kvguard_proxy_retries_total", reason="kv_integrity") == 2


async def test_a_decode_only_fallback_that_fails_gives_503_saying_so(stubs):
    p, d = await stubs(), await stubs("error500")
    config = make_config(
        [p.url], [d.url], retry={"max_attempts": 1, "on_exhausted": "decode_only"}
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
    assert "decode-only fallback failed: HTTP 500" in message
    assert ["kv_transfer_params" in body for body in d.bodies()] == [True, False]


async def test_with_no_prefill_to_pick_the_decode_only_fallback_serves_alone(stubs):
    # The prefill fails its startup probe: no attempt is made, and the
    # fallback retries nothing.
    p, d = await stubs("unhealthy"), await stubs()
    config = make_config([p.url], [d.url], retry={"on_exhausted": "decode_only"})
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["text"] == expected_text(
            "hello world", 6
        )
        metrics = await px.metrics()
    assert p.requests == []
    assert "kv_transfer_params" not in d.bodies()[0]
    assert metric(metrics, "kvguard_proxy_retries_total") == 0


# ------------------------------------ several choices or prompts: local prefill

# Bodies vLLM runs as several requests of its own: each would pull the same
# prefill's KV (docs/wire.md).
SEVERAL = {
    "n-2": {"n": 2},
    "n-lax-string": {"n": "3"},
    "two-prompts": {"prompt": ["one", "two"]},
    "two-token-prompts": {"prompt": [[1, 2], [3, 4]]},
    "prompt-and-embeds": {"prompt": "one", "prompt_embeds": "AAAA"},
}
# Bodies vLLM runs as one request.
ONE = {
    "n-1": {"n": 1},
    "one-prompt-list": {"prompt": ["one"]},
    "token-ids": {"prompt": [1, 2, 3]},
    "one-token-list": {"prompt": [[1, 2, 3]]},
}


async def served_1p1d(
    stubs: Callable[..., Any], path: str, body: dict[str, Any]
) -> tuple[StubEngine, StubEngine]:
    """A prefill and a decode stub after the proxy in front of them served
    ``body`` at ``path`` (200)."""
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post(path, body)
        assert resp.status == 200, await resp.text()
        await resp.read()
    return p, d


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("fields", SEVERAL.values(), ids=SEVERAL.keys())
async def test_a_request_vllm_runs_as_several_is_prefilled_on_the_decode(
    stubs, stream, fields
):
    body = {**COMPLETION, **fields, "stream": stream}
    p, d = await served_1p1d(stubs, "/v1/completions", body)
    assert not p.requests
    (body,) = d.bodies()
    assert "kv_transfer_params" not in body
    assert {name: body[name] for name in fields} == fields


@pytest.mark.parametrize("fields", ONE.values(), ids=ONE.keys())
async def test_a_request_vllm_runs_as_one_goes_through_a_prefill(stubs, fields):
    p, d = await served_1p1d(stubs, "/v1/completions", {**COMPLETION, **fields})
    assert len(p.requests) == 1
    assert "kv_transfer_params" in d.bodies()[0]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# Requests whose prompt logprobs vLLM computes, so that it reads no KV it did
# not compute itself (skip_reading_prefix_cache).
PROMPT_LOGPROBS = {
    "prompt-logprobs": ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1}),
    "prompt-logprobs-0": ("/v1/completions", {**COMPLETION, "prompt_logprobs": 0}),
    "echo-logprobs": ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 2}),
    "chat-echo": ("/v1/chat/completions", {**CHAT, "echo": True}),
}
# Requests that read the prefill's KV.
READS_KV = {
    "echo": ("/v1/completions", {**COMPLETION, "echo": True}),
    "logprobs": ("/v1/completions", {**COMPLETION, "logprobs": 2}),
    "prompt-logprobs-null": (
        "/v1/completions",
        {**COMPLETION, "prompt_logprobs": None},
    ),
    "chat-top-logprobs": (
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 2},
    ),
}


@pytest.mark.parametrize(
    ("path", "body"), PROMPT_LOGPROBS.values(), ids=PROMPT_LOGPROBS.keys()
)
async def test_a_request_for_prompt_logprobs_is_prefilled_on_the_decode(
    stubs, path, body
):
    # Its decode would compute the prompt again whatever the prefill sent.
    p, d = await served_1p1d(stubs, path, body)
    assert not p.requests
    assert "kv_transfer_params" not in d.bodies()[0]


@pytest.mark.parametrize(
    ("path", "body"), PROMPT_LOGPROBS.values(), ids=PROMPT_LOGPROBS.keys()
)
async def test_a_non_stream_request_for_prompt_logprobs_is_not_streamed_on_the_decode(
    stubs, path, body
):
    # vLLM puts prompt logprobs in its non-streaming reply only.
    _, d = await served_1p1d(stubs, path, body)
    assert "stream" not in d.bodies()[0]


@pytest.mark.parametrize(("path", "body"), READS_KV.values(), ids=READS_KV.keys())
async def test_a_request_without_prompt_logprobs_goes_through_a_prefill(
    stubs, path, body
):
    p, d = await served_1p1d(stubs, path, body)
    assert len(p.requests) == 1
    assert "kv_transfer_params" in d.bodies()[0]


@pytest.mark.parametrize("value", [True, "yes", 1])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_beam_search_is_prefilled_and_not_streamed_on_the_decode(
    stubs, path, value
):
    # vLLM's beam search runs steps of its own without kv_transfer_params,
    # and refuses a stream (completions).
    base = COMPLETION if path == "/v1/completions" else CHAT
    p, d = await served_1p1d(stubs, path, {**base, "use_beam_search": value})
    assert not p.requests
    (sent,) = d.bodies()
    assert "kv_transfer_params" not in sent and "stream" not in sent


@pytest.mark.parametrize("value", [False, "off", None, "maybe"])
async def test_a_request_without_a_beam_search_goes_through_a_prefill(stubs, value):
    # A value vLLM refuses ("maybe", null) gets the prefill's 400 first.
    p, _ = await served_1p1d(
        stubs, "/v1/completions", {**COMPLETION, "use_beam_search": value}
    )
    assert len(p.requests) == 1


async def test_a_chat_request_with_a_stray_prompt_list_goes_through_a_prefill(
    stubs,
):
    # Only completions read prompts: a chat request is one conversation.
    body = {**CHAT, "prompt": ["a", "b"]}
    p, _ = await served_1p1d(stubs, "/v1/chat/completions", body)
    assert len(p.requests) == 1


async def test_an_n_vllm_refuses_goes_through_a_prefill_for_its_400(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "n": "two"})
        await resp.read()
    assert p.bodies() and p.bodies()[0]["n"] == "two"


async def test_a_request_for_several_choices_is_retried_on_another_decode(stubs):
    p, bad, good = await stubs(), await stubs("error500"), await stubs()
    config = make_config(
        [p.url],
        [bad.url, good.url],
        retry={"backoff_base_s": 0, "on_exhausted": "decode_only"},
    )
    async with running_proxy(config) as px:
        for _ in range(2):
            resp = await px.post("/v1/completions", {**COMPLETION, "n": 2})
            assert resp.status == 200, await resp.text()
            await resp.read()
    assert not p.requests and len(good.requests) == 2
    assert all("kv_transfer_params" not in b for b in good.bodies())


async def test_several_choices_failing_alike_on_two_decodes_fail_fast(stubs):
    # No prefill's KV is shared between the attempts: the request is at fault.
    p = await stubs()
    decodes = [await stubs("error500") for _ in range(3)]
    config = make_config(
        [p.url],
        [d.url for d in decodes],
        retry={"max_attempts": 3, "backoff_base_s": 0},
    )
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "n": 2})
        body = await resp.json()
    assert resp.status == 500
    assert "the same way on two decode instances" in body["error"]["message"]
    assert sum(len(d.requests) for d in decodes) == 2


async def test_client_disconnect_mid_stream_aborts_the_decode(stubs):
    p, d = await stubs(), await stubs(chunk_delay=0.2)
    async with running_proxy(make_config([p.url], [d.url])) as px:
        async with aiohttp.ClientSession() as client:
            resp = await client.post(
                px.url + "/v1/completions",
                data=msgspec.json.encode(
                    {**COMPLETION, "stream": True, "max_tokens": 50}
                ),
                headers={"X-Request-Id": "gone-1"},
            )
            await resp.content.readany()
            resp.close()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if d.aborts and d.cancelled:
                break
    assert [[d.requests[0][1]["X-Request-Id"]]] == d.aborts
    assert d.cancelled == 1
    assert p.held == set()


async def test_client_disconnect_before_first_token_frees_the_prefill_kv(stubs):
    p, d = await stubs(), await stubs("hang")
    async with running_proxy(make_config([p.url], [d.url])) as px:
        async with aiohttp.ClientSession() as client:
            task = asyncio.create_task(
                client.post(
                    px.url + "/v1/completions",
                    data=msgspec.json.encode({**COMPLETION, "stream": True}),
                    headers={"X-Request-Id": "gone-2"},
                )
            )
            for _ in range(100):
                await asyncio.sleep(0.02)
                if d.requests:
                    break
            assert p.held
            task.cancel()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if not p.held and d.aborts:
                break
    assert p.held == set()
    assert [[d.requests[0][1]["X-Request-Id"]]] == d.aborts


async def test_non_stream_request_is_decoded_as_a_stream_of_16_token_chunks(stubs):
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([p.url], [d.url])) as px:
        resp = await px.post("/v1/completions", {**COMPLETION, "stream_interval": 2})
        reply = await resp.json()
    assert resp.headers["Content-Type"].startswith("application/json")
    assert reply["choices"][0]["text"] == expected_text("hello world", 6)
    (sent,) = d.bodies()
    del sent["kv_transfer_params"]
    assert sent == {
        **COMPLETION,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stream_interval": 16,
    }


async def test_a_non_stream_interval_of_1_asks_the_decode_for_no_stream_interval(
    stubs,
):
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], retry={"non_stream_interval": 1})
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200
    (sent,) = d.bodies()
    assert "stream_interval" not in sent and sent["stream"] is True


async def test_non_stream_decode_keeps_the_clients_body_when_configured_so(stubs):
    p, d = await stubs(), await stubs()
    config = make_config([p.url], [d.url], retry={"non_stream_as_stream": False})
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 200
    (sent,) = d.bodies()
    del sent["kv_transfer_params"]
    assert sent == COMPLETION


# retry.non_stream_as_stream off: a non-streamed decode's reply is read whole.
WHOLE_REPLY = {"non_stream_as_stream": False}


async def _retried_past(
    stubs: Callable[..., Any], bad: StubEngine, stream: bool = False, **retry: Any
) -> str:
    """Two requests over ``bad`` and a good decode, in that order: round
    robin starts one on ``bad``, and it is retried on the good one. Both get
    the whole text, and no error event; the proxy's metrics are returned."""
    p, good = await stubs(), await stubs()
    config = make_config(
        [p.url], [bad.url, good.url], retry={"backoff_base_s": 0, **retry}
    )
    body = {**COMPLETION, "stream": True} if stream else COMPLETION
    text = expected_text("hello world", 6)
    async with running_proxy(config) as px:
        for _ in range(2):
            resp = await px.post("/v1/completions", body)
            assert resp.status == 200, await resp.text()
            if stream:
                assert await read_sse(resp) == (text, [])
            else:
                assert (await resp.json())["choices"][0]["text"] == text
        metrics = await px.metrics()
    assert len(bad.requests) == 1 and len(good.requests) == 2
    return metrics


@pytest.mark.parametrize("status", [500, 503, 300, 302])
async def test_a_decode_reply_read_whole_that_fails_is_retried_on_another(
    stubs, status
):
    bad = await stubs("error500", error_status=status)
    await _retried_past(stubs, bad, **WHOLE_REPLY)


async def test_a_decode_reply_read_whole_with_a_4xx_is_the_clients_answer(stubs):
    p, d = await stubs(), await stubs("bad400")
    config = make_config([p.url], [d.url], retry=WHOLE_REPLY)
    async with running_proxy(config) as px:
        resp = await px.post("/v1/completions", COMPLETION)
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "bad prompt"
        await asyncio.sleep(0.1)
    assert len(d.requests) == 1
    assert p.held == set()  # the KV it prefilled is freed


@pytest.mark.parametrize("mode", ["cut", "die", "abort_late"])
async def test_a_decode_stream_collected_for_a_whole_reply_that_ends_short_is_retried(
    stubs, mode
):
    bad = await stubs(mode)
    await _retried_past(stubs, bad)
    # A stream that did not end with [DONE] may still run on the decode.
    await asyncio.sleep(0.1)
    assert len(bad.aborts) == (0 if mode == "abort_late" else 1)


async def test_non_stream_first_token_timeout_is_retried(stubs):
    p, d_hang, d_good = await stubs(), await stubs("hang"), await stubs()
    config = make_config(
        [p.url],
        [d_hang.url, d_good.url],
        retry={"backoff_base_s": 0},
        timeouts={"decode_first_token_s": 0.3, "total_s": 30},
    )
    async with running_proxy(config) as px:
        for _ in range(2):
            started = time.monotonic()
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == expected_text(
                "hello world", 6
            )
            assert time.monotonic() - started < 5
    await asyncio.sleep(0.1)
    assert len(d_hang.aborts) == len(d_hang.requests) >= 1


async def test_each_attempt_is_logged_as_one_json_line_and_integrity_failures_kept(
    stubs, caplog
):
    bad, good, d = await stubs("corrupt"), await stubs(), await stubs()
    config = make_config([bad.url, good.url], [d.url], retry={"backoff_base_s": 0})
    caplog.set_level("INFO", logger="kvguard.proxy.attempts")
    async with running_proxy(config) as px:
        started = time.monotonic()
        for i in range(2):  # round robin: one of the two starts on the bad prefill
            resp = await px.post(
                "/v1/completions", COMPLETION, headers={"X-Request-Id": f"r{i}"}
            )
            assert resp.status == 200
            await resp.read()
        elapsed_ms = (time.monotonic() - started) * 1000
        recent = list(px.state.recent_failures)
    records = [
        msgspec.json.decode(r.getMessage())
        for r in caplog.records
        if r.name == "kvguard.proxy.attempts"
    ]
    failed = [r for r in records if r["outcome"] == "kv_integrity"]
    assert len(failed) == 1 and len(records) == 3
    (fail,) = failed
    retry = next(
        r for r in records if r["attempt_id"] == fail["attempt_id"] + "-retry1"
    )
    assert fail["prefill"] == bad.url and retry["prefill"] == good.url
    for record in (fail, retry):
        assert record["decode"] == d.url
        assert record["request_id"] == fail["request_id"]
        assert record["route"] == "completions" and record["stream"] is False
        assert record["kv_params"] is True
        assert 0 <= record["prefill_ms"] <= record["total_ms"] <= elapsed_ms
    assert (fail["attempt"], retry["attempt"]) == (0, 1)
    assert INTEGRITY_MARKER in fail["error"] and fail["status"] == 200
    assert retry["outcome"] == "ok" and "error" not in retry
    # /status keeps the failed attempt's record.
    assert [r["attempt_id"] for r in recent] == [fail["attempt_id"]]


async def test_only_a_decode_that_loaded_the_prefills_kv_counts_as_a_clean_load(
    stubs, monkeypatch
):
    # A prefill that gives no kv_transfer_params leaves its decode to prefill
    # locally: no transfer between the two, so no evidence for ejection.
    no_kv = await stubs(
        prefill_reply=b'{"choices": [{"index": 0, "text": " x"}], '
        b'"kv_transfer_params": null}'
    )
    p, d = await stubs(), await stubs()
    async with running_proxy(make_config([no_kv.url, p.url], [d.url])) as px:
        tracker = px.state.tracker
        clean: list[tuple[str, str]] = []

        def record_success(prefill: Any, decode: Any) -> Any:
            clean.append((prefill.url, decode.url))
            return type(tracker).record_success(tracker, prefill, decode)

        monkeypatch.setattr(tracker, "record_success", record_success)
        for _ in range(2):  # round robin: one request on each prefill
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200, await resp.text()
    assert ["kv_transfer_params" in body for body in d.bodies()].count(False) == 1
    assert clean == [(p.url, d.url)]


async def test_a_prefill_without_kv_transfer_params_is_counted_and_logged_once(
    stubs, caplog, monkeypatch
):
    # A prefill instance without a KV connector answers 200 with no params:
    # every decode then prefills again, which an operator must be able to see.
    monkeypatch.setenv("ADM", "adm")
    no_kv = await stubs(
        prefill_reply=b'{"choices": [{"index": 0, "text": " x"}], '
        b'"kv_transfer_params": null}'
    )
    p, d = await stubs(), await stubs()
    config = make_config([no_kv.url, p.url], [d.url], auth={"admin_key_env": "ADM"})
    caplog.set_level("WARNING", logger="kvguard.proxy")
    async with running_proxy(config) as px:
        for _ in range(6):  # round robin: three on each prefill
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200, await resp.text()
        metrics = await px.metrics()
        # The instance's series leaves with it.
        status, _ = await admin(
            px, "DELETE", "/admin/instances", json={"url": no_kv.url}
        )
        assert status == 200
        after = await px.metrics()
    name = "kvguard_proxy_prefills_without_kv_params_total"
    assert metric(metrics, name, instance=no_kv.url) == 3
    assert metric(metrics, name) == 3  # none for the prefill that sent params
    assert metric(after, name) == 0 and name + "{" not in after
    assert ["kv_transfer_params" in body for body in d.bodies()].count(False) == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvguard.proxy"]
    assert len([w for w in warnings if "without kv_transfer_params" in w]) == 1


async def test_attempts_logging_off_logs_none_yet_keeps_integrity_failures(
    stubs, caplog
):
    bad, good, d = await stubs("corrupt"), await stubs(), await stubs()
    config = make_config(
        [bad.url, good.url],
        [d.url],
        retry={"backoff_base_s": 0},
        logging={"attempts": False},
    )
    caplog.set_level("INFO", logger="kvguard.proxy.attempts")
    async with running_proxy(config) as px:
        for _ in range(2):  # round robin: one of the two starts on the bad prefill
            resp = await px.post("/v1/completions", COMPLETION)
            assert resp.status == 200
            await resp.read()
        recent = list(px.state.recent_failures)
    assert [r for r in caplog.records if r.name == "kvguard.proxy.attempts"] == []
    assert [(r["prefill"], r["outcome"]) for r in recent] == [(bad.url, "kv_integrity")]
