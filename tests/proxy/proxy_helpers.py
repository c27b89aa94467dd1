"""Fixtures for the proxy's tests: a tiny in-process P/D backend, a config maker.

The stub backend speaks just enough of vLLM's P/D protocol (docs/wire.md) to test
the proxy's flow without torch: a prefill answers one token and
``kv_transfer_params`` and holds the "KV" until a decode pulls it or an abort
frees it; a decode pulls it from the prefill stub named in the params and
fails with "KV checksum mismatch" when that prefill corrupts. The
end-to-end behaviours are also tested against the real fake engine.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from proxy.config import ProxyConfig
from proxy.protocol import INTEGRITY_MARKER
from proxy.testing import RunningProxy, running_proxy

_STUBS: dict[int, StubEngine] = {}


async def admin(
    px: RunningProxy, method: str, path: str, key: str | None = "adm", **kwargs: Any
) -> tuple[int, Any]:
    """The status and JSON body of an admin API call, with ``key`` (None: no
    Authorization header); ``kwargs`` go to the request (``json=...``)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with px.session.request(
        method, px.url + path, headers=headers, **kwargs
    ) as resp:
        return resp.status, await resp.json()


async def add_prefill(px: RunningProxy, url: str) -> tuple[int, Any]:
    """The admin API's answer to adding the prefill at ``url``."""
    return await admin(
        px, "POST", "/admin/instances", json={"role": "prefill", "url": url}
    )


def expected_text(prompt: Any, max_tokens: int) -> str:
    """What every stub (prefill+decode, or monolithic) generates for a prompt."""
    seed = sum(msgspec.json.encode(prompt)) % 97
    return "".join(f" w{(seed + i) % 50}" for i in range(max_tokens))


@dataclass
class StubEngine:
    """One backend; ``mode`` picks a failure to simulate."""

    port: int = 0
    # ok|corrupt|integrity|error500|hang|empty|abort|abort_late|die|cut|bad400
    mode: str = "ok"
    requests: list[tuple[str, Mapping[str, str], dict[str, Any]]] = field(
        default_factory=list
    )
    aborts: list[list[str]] = field(default_factory=list)
    held: set[str] = field(default_factory=set)
    cancelled: int = 0
    chunk_delay: float = 0.0
    # The status of mode error500's replies.
    error_status: int = 500
    # Seconds /health takes to answer, and how many it was asked.
    health_delay: float = 0.0
    health_checks: int = 0
    # Seconds a prefill takes before it answers.
    prefill_delay: float = 0.0
    # Resets (RST, before any reply) a request on a connection idle this long:
    # what a client sees when it reuses a connection the server just closed.
    reset_idle_s: float | None = None
    resets: int = 0
    # Pads each JSON reply (prefill, non-stream decode) and stream event with
    # this many bytes; JSON replies go chunked (no Content-Length) if ``chunked``.
    pad_bytes: int = 0
    chunked: bool = False
    # The leg ("prefill", "decode", "any") on which the prompt [""] crashes
    # the engine (500): a request whose content breaks every engine.
    poison_leg: str = "any"
    # A Set-Cookie header on every reply (as a gateway's sticky session does).
    set_cookie: str | None = None
    # The entries of its /v1/models (vLLM's give max_model_len); by default
    # one without, named after the port.
    served: list[dict[str, Any]] | None = None
    # Served over TLS with this context (an https URL) when set.
    ssl_context: ssl.SSLContext | None = None
    # Data events (payloads) a decode streams instead of its text.
    events: list[bytes] | None = None
    # The body a prefill answers instead of its token and params.
    prefill_reply: bytes | None = None
    runner: web.AppRunner | None = None
    _idle_since: dict[Any, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        scheme = "http" if self.ssl_context is None else "https"
        return f"{scheme}://127.0.0.1:{self.port}"

    def bodies(self, path: str = "") -> list[dict[str, Any]]:
        return [b for p, _, b in self.requests if path in p]

    def _reset_if_idle(self, request: web.Request) -> bool:
        transport = request.transport
        if self.reset_idle_s is None or transport is None:
            return False
        now = asyncio.get_running_loop().time()
        since = self._idle_since.get(transport)
        if since is None or now - since < self.reset_idle_s:
            return False
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
        self.resets += 1
        return True

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if self._reset_if_idle(request):
            return web.Response()
        try:
            return await self._answer(request)
        finally:
            if request.transport is not None:
                self._idle_since[request.transport] = asyncio.get_running_loop().time()

    async def _json(
        self, request: web.Request, obj: dict[str, Any]
    ) -> web.StreamResponse:
        if self.pad_bytes:
            obj = {**obj, "padding": "x" * self.pad_bytes}
        if not self.chunked:
            return web.json_response(obj)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        data = msgspec.json.encode(obj)
        for i in range(0, len(data), 65536):
            await resp.write(data[i : i + 65536])
        await resp.write_eof()
        return resp

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "application/json":  # as vLLM
            return web.json_response({"error": {"message": "not JSON"}}, status=415)
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except RecursionError:
            body = {"unparsable": True}
        self.requests.append((request.path, request.headers.copy(), body))
        rid = request.headers.get("X-Request-Id", "none")
        if self.mode == "bad400":
            return web.json_response(
                {
                    "error": {
                        "message": "bad prompt",
                        "type": "BadRequestError",
                        "code": 400,
                    }
                },
                status=400,
            )
        if self.mode == "error500":
            return web.json_response(
                {
                    "error": {
                        "message": "engine dead",
                        "type": "InternalServerError",
                        "code": self.error_status,
                    }
                },
                status=self.error_status,
            )
        kvp = body.get("kv_transfer_params")
        prompt = body.get("prompt", body.get("messages"))
        leg = "prefill" if kvp and kvp.get("do_remote_decode") else "decode"
        if prompt == [""] and self.poison_leg in (leg, "any"):
            return web.json_response(
                {
                    "error": {
                        "message": "engine step failed",
                        "type": "InternalServerError",
                        "code": self.error_status,
                    }
                },
                status=self.error_status,
            )
        if leg == "prefill":
            if self.prefill_delay:
                try:
                    await asyncio.sleep(self.prefill_delay)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            if self.prefill_reply is not None:
                return web.Response(
                    body=self.prefill_reply, content_type="application/json"
                )
            internal = f"internal-{rid}"
            self.held.add(internal)
            return await self._json(
                request,
                {
                    "id": rid,
                    "choices": [{"index": 0, "text": expected_text(prompt, 1)}],
                    "kv_transfer_params": {
                        "do_remote_prefill": True,
                        "do_remote_decode": False,
                        "remote_block_ids": [[1, 2, 3]],
                        "remote_engine_id": f"engine-{self.port}",
                        "remote_request_id": internal,
                        "remote_host": "127.0.0.1",
                        "remote_port": self.port,
                        "tp_size": 1,
                        "kv_checksums": "AAEC",
                        "future_field": {"x": 1},
                    },
                },
            )
        if self.mode == "hang":  # stuck before pulling the KV
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        failed = self.mode == "integrity"
        if kvp:
            source = _STUBS.get(int(kvp.get("remote_port", -1)))
            if source is not None:
                source.held.discard(kvp.get("remote_request_id"))
                failed = failed or source.mode == "corrupt"
        max_tokens = int(
            body.get("max_tokens") or body.get("max_completion_tokens") or 8
        )
        text = expected_text(prompt, max_tokens)
        stream = bool(body.get("stream"))
        err = {
            "error": {
                "message": f"{INTEGRITY_MARKER} in block 1",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        if not stream:
            if failed:
                return web.json_response(err, status=500)
            return await self._json(
                request,
                {
                    "id": rid,
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text}],
                },
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if failed:
                await resp.write(
                    b"data: " + msgspec.json.encode(err) + b"\n\ndata: [DONE]\n\n"
                )
                return resp
            if self.mode == "empty":
                await resp.write(b": keep-alive\n\ndata: [DONE]\n\n")
                return resp
            if self.mode == "abort":  # dropped before its first token
                chunk = {"id": rid, "choices": [{"text": "", "finish_reason": "abort"}]}
                await resp.write(
                    b"data: " + msgspec.json.encode(chunk) + b"\n\ndata: [DONE]\n\n"
                )
                return resp
            if self.events is not None:
                for event in self.events:
                    await resp.write(b"data: " + event + b"\n\n")
                    if self.chunk_delay:
                        await asyncio.sleep(self.chunk_delay)
                await resp.write(b"data: [DONE]\n\n")
                return resp
            words = text.split(" ")[1:]
            for i, word in enumerate(words):
                chunk = {"id": rid, "choices": [{"index": 0, "text": " " + word}]}
                if self.pad_bytes:
                    chunk["padding"] = "x" * self.pad_bytes
                await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                if self.mode == "die" and i == 1:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if self.mode == "cut" and i == 1:  # a clean end, but no [DONE]
                    await resp.write_eof()
                    return resp
                if self.mode == "abort_late" and i == 1:
                    # Dropped after its first tokens, the abort event written
                    # in two pieces that reach the proxy in two reads.
                    done = {
                        "id": rid,
                        "choices": [{"text": "", "finish_reason": "abort"}],
                    }
                    event = b"data: " + msgspec.json.encode(done) + b"\n\n"
                    cut = event.index(b'"abort"') + 3
                    await resp.write(event[:cut])
                    await asyncio.sleep(0.1)
                    await resp.write(event[cut:] + b"data: [DONE]\n\n")
                    return resp
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return resp

    async def _abort(self, request: web.Request) -> web.Response:
        ids = (await request.json())["request_ids"]
        self.aborts.append(ids)
        for rid in ids:
            self.held.discard(rid)
        return web.Response()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        return web.json_response({}, status=503 if self.mode == "unhealthy" else 200)

    async def _models(self, request: web.Request) -> web.Response:
        served = self.served
        if served is None:
            served = [{"id": f"m{self.port % 2}"}]
        return web.json_response({"object": "list", "data": served})

    async def _add_cookie(
        self, request: web.Request, response: web.StreamResponse
    ) -> None:
        assert self.set_cookie is not None
        response.headers["Set-Cookie"] = self.set_cookie

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/inference/v1/abort_requests", self._abort)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        if self.set_cookie is not None:
            app.on_response_prepare.append(self._add_cookie)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        _STUBS[self.port] = self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        _STUBS.pop(self.port, None)


@pytest.fixture
async def stubs() -> AsyncIterator[Callable[..., Any]]:
    """``await make(mode=...)`` starts a stub backend; all stop at teardown."""
    started: list[StubEngine] = []

    async def make(mode: str = "ok", **kwargs: Any) -> StubEngine:
        stub = StubEngine(mode=mode, **kwargs)
        await stub.start()
        started.append(stub)
        return stub

    yield make
    for stub in started:
        await stub.stop()


async def one_attempt(
    prefill: StubEngine, decode: StubEngine, path: str, body: Any
) -> tuple[int, Mapping[str, str], bytes]:
    """Starts both stubs and a proxy in front of them that makes one attempt
    per request, posts ``body`` (JSON) to ``path``: (status, headers, body).
    All stop after it."""
    await prefill.start()
    await decode.start()
    try:
        config = make_config([prefill.url], [decode.url], retry={"max_attempts": 1})
        async with running_proxy(config) as px:
            resp = await px.post(path, body)
            return resp.status, resp.headers, await resp.read()
    finally:
        await prefill.stop()
        await decode.stop()


def make_config(
    prefill: list[str],
    decode: list[str],
    model: str = "*",
    decode_policy: str = "round_robin",
    **sections: Any,
) -> ProxyConfig:
    """A config for one model, health probes slowed so tests control them."""
    sections.setdefault("health", {"interval_s": 30})
    return ProxyConfig.model_validate(
        {
            "models": {
                model: {
                    "prefill": {"instances": [{"url": u} for u in prefill]},
                    "decode": {
                        "policy": decode_policy,
                        "instances": [{"url": u} for u in decode],
                    },
                }
            },
            **sections,
        }
    )


def body(route: str, prompt: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    """A completions or chat request for ``prompt``."""
    if route == "/v1/completions":
        return {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def text_of(route: str, reply: dict[str, Any]) -> str:
    """The first choice's text of a whole completions or chat answer."""
    choice = reply["choices"][0]
    return str(
        choice["text"] if route == "/v1/completions" else choice["message"]["content"]
    )


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[str, list[Any]]:
    """(concatenated text, list of error objects) of an SSE completion stream."""
    text = []
    errors = []
    raw = (await resp.read()).decode()
    for event in raw.split("\n\n"):
        if not event.startswith("data: "):
            continue
        data = event[6:]
        if data == "[DONE]":
            continue
        obj = msgspec.json.decode(data)
        if "error" in obj:
            errors.append(obj["error"])
            continue
        choice = obj["choices"][0]
        text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text), errors
