"""What the real-vLLM tests and benchmarks send to vLLM instances and
KVGuard proxies (completions, streamed or not) and read back (texts, error
messages, Prometheus metrics). (Starting them: ``vllm_servers``.)
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# The name every test instance serves its model under (--served-model-name).
MODEL_NAME = "tiny-llama"
# Seconds a request may take, end to end.
REQUEST_TIMEOUT_S = 120.0


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    request_id: str | None = None,
) -> tuple[int, Any]:
    """POST JSON; the status and the decoded JSON (or text) answer."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with session.post(url, json=body, headers=headers, timeout=timeout) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def complete(
    session: aiohttp.ClientSession,
    base_url: str,
    prompt: str,
    *,
    max_tokens: int = 12,
    request_id: str | None = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> tuple[int, Any]:
    """A temperature-0 completion."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return await post(session, f"{base_url}/v1/completions", body, request_id)


def text_of(answer: Any) -> str:
    """The completion text of an answer."""
    return str(answer["choices"][0]["text"])


def error_message(answer: Any) -> str:
    """The error message of an error answer."""
    if isinstance(answer, dict):
        return str(answer.get("error", {}).get("message", answer))
    return str(answer)


async def metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The server's Prometheus samples summed by ``name{label=value,...}``
    (labels other than model_name and engine kept), and by bare name."""
    async with session.get(f"{base_url}/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {
                k: v
                for k, v in sample.labels.items()
                if k not in ("model_name", "engine")
            }
            keys = [sample.name]
            if labels:
                keys.append(
                    sample.name
                    + "{"
                    + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                    + "}"
                )
            for key in keys:
                samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def deltas(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per sample (absent counts as 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def prompts(count: int, seed: int = 0, words: tuple[int, int] = (20, 150)) -> list[str]:
    """Distinct prompts of ``words`` words (about two tokens each), none a
    prefix of another."""
    vocabulary = [
        "producer", "consumer", "checksum", "block", "prefill", "decode",
        "cache", "key", "value", "token", "layer", "head", "proxy", "retry",
        "bit", "flip", "memory", "wire", "kernel", "model", "request", "load",
        "verify", "mismatch", "engine", "quick", "brown", "fox", "river",
        "number", "seven", "twelve", "three",
    ]  # fmt: skip
    rng = random.Random(seed)
    return [
        f"Prompt {i}: "
        + " ".join(rng.choice(vocabulary) for _ in range(rng.randint(*words)))
        for i in range(count)
    ]


async def stream_text(
    session: aiohttp.ClientSession,
    base_url: str,
    prompt: str,
    *,
    max_tokens: int,
    request_id: str,
) -> str:
    """A streamed temperature-0 completion's text.

    Raises:
        AssertionError: On a status other than 200 or an error event.
    """
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    parts: list[str] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with session.post(
        f"{base_url}/v1/completions",
        json=body,
        headers={"X-Request-Id": request_id},
        timeout=timeout,
    ) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            assert "error" not in event, event
            parts.append(event["choices"][0]["text"])
    return "".join(parts)
