"""What a backend says it serves: its ``GET /v1/models``.

Read for the proxy's own ``/v1/models`` (the union over backends) and, by
the health checks, for each decode's context length (``max_model_len``),
so that a request asking for more output than that is refused before its
prefill runs (docs/wire.md, "Fields only the decode reads").
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from proxy.instances import Instance
from proxy.upstream import ReplyTooLarge, read_capped

_decode_json = msgspec.json.Decoder().decode


async def served_models(
    session: aiohttp.ClientSession, inst: Instance, timeout_s: float, max_bytes: int
) -> list[dict[str, Any]]:
    """The entries (each with an ``id``) of ``inst``'s ``GET /v1/models``;
    none when it does not answer 200 with a list of them in time."""
    try:
        async with session.get(
            inst.url + "/v1/models",
            headers=inst.headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                return []
            data = _decode_json(await read_capped(resp, max_bytes))
    except (
        TimeoutError,
        aiohttp.ClientError,
        ValueError,  # a URL that yarl refuses
        msgspec.DecodeError,
        RecursionError,
        ReplyTooLarge,
    ):
        return []
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and "id" in e]


def context_lens(entries: list[dict[str, Any]]) -> dict[str, int]:
    """``id`` → ``max_model_len`` of the entries that give one (vLLM's base
    models do) or whose ``parent`` does (vLLM's LoRA adapters, served
    within their base model's context)."""
    lens: dict[str, int] = {}
    for entry in entries:
        value = entry.get("max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            lens[str(entry["id"])] = value
    for entry in entries:
        name, parent = str(entry["id"]), entry.get("parent")
        if name not in lens and isinstance(parent, str) and parent in lens:
            lens[name] = lens[parent]
    return lens
