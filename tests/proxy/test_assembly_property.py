"""A non-streaming reply the proxy assembles from a decode's stream is the
reply the engine itself gives without a stream (its id and time aside), for
any request the proxy assembles: the fake engine answers both as vLLM 0.32
does (``tests/vllm/test_fake_engine_wire.py``), and the request goes through
the flow's own ``stream_body``, event reader and ``Assembler``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_engine.config import Role
from fake_engine.testing import EngineSpec, fake_engines
from proxy.assemble import Assembler
from proxy.body import (
    Route,
    computed_alone,
    parse_request,
    returns_token_ids,
    stream_body,
    streams_alike,
)
from proxy.sse import EventReader

# An engine starts and answers two requests in about 20 ms.
EXAMPLES = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PATHS = {Route.COMPLETIONS: "/v1/completions", Route.CHAT: "/v1/chat/completions"}
TEXTS = ["hello there", "tell me about block 7 of the cache", "a"]


@st.composite
def requests(draw: st.DrawFn) -> tuple[Route, dict[str, Any]]:
    """A non-streaming request the proxy assembles, with the fields that
    shape a reply: choices, prompts, logprobs, token ids, stops, lengths."""
    route = draw(st.sampled_from(list(PATHS)))
    body: dict[str, Any] = {"max_tokens": draw(st.integers(1, 40))}
    if route is Route.COMPLETIONS:
        body["prompt"] = draw(
            st.one_of(
                st.sampled_from(TEXTS),
                st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3),
                st.lists(st.integers(1, 200), min_size=1, max_size=6),
            )
        )
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 3))
        if draw(st.booleans()):
            body["echo"] = True
    else:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(TEXTS))}]
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        body["return_token_ids"] = True
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(st.sampled_from(["e", " ", "zz"]), max_size=2))
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, body["max_tokens"]))
    if draw(st.booleans()):
        body["temperature"] = 1.0
        body["seed"] = draw(st.integers(0, 5))
    return route, body


async def both_replies(
    route: Route, body: dict[str, Any], interval: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine's own non-streaming reply, the one assembled from its
    stream of the body the flow sends)."""
    req = parse_request(json.dumps(body).encode(), route)
    assert not computed_alone(req, route) and streams_alike(req)
    async with (
        fake_engines(EngineSpec(role=Role.BOTH)) as (engine,),
        aiohttp.ClientSession() as session,
    ):
        url = engine + PATHS[route]
        headers = {"Content-Type": "application/json"}
        async with session.post(url, data=req.raw, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            want = await resp.json()
        stream_req = stream_body(req, interval)
        async with session.post(url, data=stream_req, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            stream = await resp.read()
    reply = Assembler(prompt_token_ids=returns_token_ids(req))
    for data in EventReader().feed(stream):
        if data.strip() == b"[DONE]":
            break
        reply.feed(json.loads(data))
    return want, reply.result()


@EXAMPLES
@given(requests(), st.sampled_from([1, 16]))
def test_an_assembled_reply_is_the_engines_own_non_streaming_reply(
    request: tuple[Route, dict[str, Any]], interval: int
) -> None:
    route, body = request
    if route is Route.COMPLETIONS and body.get("echo") and "logprobs" in body:
        body.pop("echo")  # prompt logprobs: computed alone, not assembled
    want, got = asyncio.run(both_replies(route, body, interval))
    for reply in (want, got):
        reply.pop("id")
        reply.pop("created")
    assert got == want
