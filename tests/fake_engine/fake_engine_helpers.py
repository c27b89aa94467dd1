"""Helpers for the fake engine's tests: requests as a proxy sends them, SSE
parsing and metric reading."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from proxy.body import PREFILL_KV_PARAMS
from tests.support.metrics import fetch_metric

# 70 tokens: 5 blocks of 16 (the last holds 6), 3 of 32 (the last holds 6).
PROMPT = "The quick brown fox jumps over the lazy dog; KV blocks travel far away"
assert len(PROMPT) == 70

# The ``url`` fixture's engine (conftest.py): short enough for tests of
# too-long prompts and output budgets.
MAX_MODEL_LEN = 256

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": PROMPT},
        ],
        "max_tokens": 12,
        "ignore_eos": True,
        **fields,
    }


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """Status and JSON answer (None for an empty body)."""
    async with session.post(url, json=body, headers=headers) as response:
        return await _answer(response)


async def post_bytes(
    session: aiohttp.ClientSession,
    url: str,
    data: bytes,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """:func:`post` of a raw body: malformed JSON, another media type."""
    async with session.post(url, data=data, headers=headers) as response:
        return await _answer(response)


async def _answer(response: aiohttp.ClientResponse) -> tuple[int, Any]:
    data = await response.read()
    return response.status, msgspec.json.decode(data) if data else None


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, list[Any]]:
    """The events of an SSE answer, ``"[DONE]"`` as such; checks framing."""
    async with session.post(url, json=body) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = (await response.read()).decode()
    events: list[Any] = []
    for frame in raw.split("\n\n")[:-1]:
        assert frame.startswith("data: "), frame
        data = frame.removeprefix("data: ")
        events.append(data if data == "[DONE]" else msgspec.json.decode(data))
    assert raw.endswith("\n\n")
    return response.status, events


def text_of(response: dict[str, Any]) -> str:
    choice = response["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert isinstance(text, str)
    return text


def streamed_text(events: list[Any]) -> str:
    text = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices", ()):
                text.append(
                    choice["text"]
                    if "text" in choice
                    else choice["delta"].get("content", "")
                )
    return "".join(text)


async def prefill(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    request_id: str | None = None,
) -> dict[str, Any]:
    """A proxy's prefill request; returns the producer's kv_transfer_params."""
    prefill_body = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_KV_PARAMS,
    }
    prefill_body.pop("stream_options", None)
    headers = {"X-Request-Id": request_id} if request_id else None
    status, response = await post(session, url + path, prefill_body, headers)
    assert status == 200, response
    params = response["kv_transfer_params"]
    assert isinstance(params, dict) and params["do_remote_prefill"]
    return params


async def pd(
    session: aiohttp.ClientSession,
    prefill_url: str,
    decode_url: str,
    path: str,
    body: dict[str, Any],
) -> tuple[int, Any]:
    """Prefill then decode, as a P/D proxy does; the decode's answer."""
    params = await prefill(session, prefill_url, path, body)
    return await post(
        session, decode_url + path, {**body, "kv_transfer_params": params}
    )


# One metrics scraper for every test (tests/support/metrics.py).
metric = fetch_metric
