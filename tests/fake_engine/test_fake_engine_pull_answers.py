"""A decode whose producer answers its KV pull with anything (any status,
content type or bytes; a well-formed header over the wrong KV) fails the
request as a failed load, or verifies the KV it got: it never hangs, never
answers other text with 200 and keeps serving."""

from __future__ import annotations

import random
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
from aiohttp import web
from fake_engine_helpers import (
    COMPLETIONS,
    PROMPT,
    completion_body,
    pd,
    post,
    prefill,
    text_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_engine.config import Role
from fake_engine.testing import EngineSpec, fake_engines
from fake_engine.transfer import PULL_PATH, decode_pull_request


@dataclass
class Answer:
    """What the stub producer answers a pull with."""

    status: int = 200
    content_type: str = "application/x-kvguard-kv"
    body: bytes = b""


class StubProducer:
    """An HTTP server answering every KV pull with ``answer``."""

    def __init__(self) -> None:
        self.answer = Answer()
        self.pulls = 0
        self.port = 0

    async def pull(self, request: web.Request) -> web.Response:
        decode_pull_request(await request.read())
        self.pulls += 1
        return web.Response(
            status=self.answer.status,
            body=self.answer.body,
            headers={"Content-Type": self.answer.content_type},
        )


# The decode, and its model's shape as a pull answer's header gives it.
_DECODE = EngineSpec(role=Role.CONSUMER, fail_closed=True)
assert _DECODE.dtype == "float16"
_SHAPE = {
    "layers": _DECODE.layers,
    "heads": _DECODE.kv_heads,
    "head_size": _DECODE.head_size,
    "dtype": _DECODE.dtype,
}
# Bytes of KV per token slot: K and V of every layer and head, 2 per element.
_SLOT_BYTES = _DECODE.layers * _DECODE.kv_heads * 2 * _DECODE.head_size * 2


# KV bodies are bytes from a seed: too large for Hypothesis to draw.
_SEEDS = st.integers(0, 2**32 - 1)


def _bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _framed(header: dict[str, object], body: bytes) -> bytes:
    head = msgspec.msgpack.encode(header)
    return struct.pack("<I", len(head)) + head + body


_HEADERS = st.fixed_dictionaries(
    {
        "version": st.sampled_from([1, 1, 2]),
        "engine_id": st.text(max_size=8),
        "request_id": st.text(max_size=8),
        "num_tokens": st.integers(-2, 200),
        "block_size": st.sampled_from([-16, 0, 1, 16, 32]),
        "num_blocks": st.integers(-2, 12),
        "layers": st.sampled_from([_DECODE.layers, _DECODE.layers + 1]),
        "heads": st.just(_DECODE.kv_heads),
        "head_size": st.just(_DECODE.head_size),
        "dtype": st.sampled_from([_DECODE.dtype, "bfloat16", "fp8", "int4"]),
    }
)


@st.composite
def _well_framed(draw: st.DrawFn) -> bytes:
    """A header, and a body of about the size it says (or exactly)."""
    header = draw(_HEADERS)
    slots = header["num_blocks"] * header["block_size"]  # type: ignore[operator]
    size = max(0, slots * _SLOT_BYTES)
    size += draw(st.sampled_from([0, 0, 0, -2, 2]))
    return _framed(header, _bytes(draw(_SEEDS), max(0, size)))


@st.composite
def _model_kv(draw: st.DrawFn) -> bytes:
    """An answer the decode lands: its model's KV of enough tokens, of any
    bytes."""
    num_blocks = draw(st.integers(5, 8))
    header = {
        "version": 1,
        "engine_id": "e",
        "request_id": "r",
        "num_tokens": draw(st.integers(len(PROMPT), num_blocks * 16)),
        "block_size": 16,
        "num_blocks": num_blocks,
        **_SHAPE,
    }
    size = num_blocks * 16 * _SLOT_BYTES
    return _framed(header, _bytes(draw(_SEEDS), size))


_ANSWERS = st.builds(
    Answer,
    status=st.sampled_from([200, 200, 204, 404, 409, 500, 503]),
    content_type=st.sampled_from(
        [
            "application/x-kvguard-kv",
            "text/plain; charset=utf-8",
            "text/plain; charset=no-such-charset",
            "application/json",
        ]
    ),
    body=st.binary(max_size=64) | _well_framed() | _model_kv(),
)


@pytest.fixture
async def decode_and_stub() -> AsyncIterator[tuple[str, str, StubProducer]]:
    """A producer, a fail-closed decode, and a stub producer on its own port."""
    stub = StubProducer()
    app = web.Application()
    app.router.add_post(PULL_PATH, stub.pull)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    stub.port = runner.addresses[0][1]
    specs = (
        EngineSpec(role=Role.PRODUCER, lease_s=5.0),
        _DECODE,
    )
    try:
        async with fake_engines(*specs) as urls:
            yield urls[0], urls[1], stub
    finally:
        await runner.cleanup()


@settings(
    max_examples=80,
    deadline=None,
    # One decode serves every example: it must keep serving.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(answer=_ANSWERS)
async def test_a_decode_given_any_pull_answer_fails_the_load_or_verifies_it(
    session: aiohttp.ClientSession,
    decode_and_stub: tuple[str, str, StubProducer],
    answer: Answer,
) -> None:
    prefill_url, decode_url, stub = decode_and_stub
    status, clean = await pd(
        session, prefill_url, decode_url, COMPLETIONS, completion_body()
    )
    assert status == 200, clean
    params = await prefill(session, prefill_url, COMPLETIONS, completion_body())
    stub.answer = answer
    pulls = stub.pulls
    params = {**params, "remote_port": stub.port}
    body = {**completion_body(), "kv_transfer_params": params}
    status, got = await post(session, decode_url + COMPLETIONS, body)
    assert stub.pulls == pulls + 1
    assert isinstance(got, dict), got
    if status == 200:
        assert text_of(got) == text_of(clean)
    else:
        assert status == 500, got
        assert got["error"]["code"] == 500
        assert got["error"]["message"].startswith(
            ("KV transfer failed", "KV checksum mismatch")
        ), got
