"""A P/D pair of another model than the tiny llama (a hybrid, a
sliding-window one), for the tests of KVGuard on that model's kinds of KV
cache group: the model made locally, the pair and a proxy started with the
llama's instances stopped (two cores), and a stage of corrupted loads
retried through the proxy.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from vllm_client import complete, deltas, metrics, text_of
from vllm_servers import REPO, VLLM_PYTHON, EngineSpec, Servers

PRODUCER = "own-producer"
CONSUMER = "own-consumer"
PROXY = "own-proxy"
FLIPPED = "Fault injection: flipped a bit"
INTEGRITY_RETRIES = "kvguard_proxy_retries_total{reason=kv_integrity}"
# The worker's startup line naming the groups it checksums.
_COVERED = re.compile(r"KVGuard checksums \d+ KV layers \(groups (.*); skipped \[\]\)")


def ensure_model(out: Path, script: str, *args: str) -> str:
    """The model's folder, made by ``scripts/<script>`` if absent."""
    if not (out / "model.safetensors").exists():
        subprocess.run(
            [VLLM_PYTHON, str(REPO / "scripts" / script), str(out), *args],
            check=True,
            timeout=300,
        )
    return str(out)


async def start_pair(
    servers: Servers, producer: EngineSpec, consumer: EngineSpec
) -> None:
    """Stop every other instance and proxy, then start the pair and a proxy
    in front of it."""
    for name, server in servers.engines.items():
        if name not in (PRODUCER, CONSUMER):
            server.stop()
    for proxy in servers.proxies.values():
        proxy.stop()
    await servers.use(
        {PRODUCER: producer, CONSUMER: consumer}, {PROXY: (PRODUCER, CONSUMER)}
    )


def stop_pair(servers: Servers) -> None:
    servers.proxy(PROXY).stop()
    servers.engine(PRODUCER).stop()
    servers.engine(CONSUMER).stop()


def covered_groups(servers: Servers, name: str) -> str:
    """The groups an instance's KVGuard worker checksums, as it logged them
    (``"0: mamba, 1: full_attention"``); none may be skipped.

    Raises:
        AssertionError: If it logged none, or skipped a group.
    """
    log = servers.engine(name).log_path.read_text(errors="replace")
    match = _COVERED.search(log)
    assert match, f"{name} logged no KVGuard layers without skipped groups"
    return match.group(1)


async def local_answers(
    http: aiohttp.ClientSession, url: str, prompts: list[str], max_tokens: int
) -> dict[str, str]:
    """Each prompt's answer from one instance, prefilled and decoded there."""
    answers = {}
    for prompt in prompts:
        status, answer = await complete(http, url, prompt, max_tokens=max_tokens)
        assert status == 200, answer
        answers[prompt] = text_of(answer)
    return answers


@dataclass
class Stage:
    """What a stage through the proxy changed: the consumer's and the
    proxy's metrics, loads the consumer's fault injector corrupted, and the
    answers."""

    consumer: dict[str, float]
    proxy: dict[str, float]
    corrupted: int
    answers: dict[str, str]

    def count(self, name: str) -> float:
        return self.consumer.get(f"kvguard_kv_{name}_total", 0.0)

    @property
    def retries(self) -> float:
        return self.proxy.get("kvguard_proxy_retries_total", 0.0)

    @property
    def integrity_retries(self) -> float:
        return self.proxy.get(INTEGRITY_RETRIES, 0.0)


async def through_proxy(
    http: aiohttp.ClientSession,
    servers: Servers,
    prompts: list[str],
    max_tokens: int,
    tag: str,
) -> Stage:
    """Each prompt through the proxy, one after the other (each must answer
    200)."""
    consumer, proxy = servers.engine(CONSUMER), servers.proxy(PROXY)
    before = {
        "consumer": await metrics(http, consumer.url),
        "proxy": await metrics(http, proxy.url),
    }
    flipped = consumer.log_count(FLIPPED)
    answers: dict[str, str] = {}
    for i, prompt in enumerate(prompts):
        status, answer = await complete(
            http, proxy.url, prompt, max_tokens=max_tokens, request_id=f"{tag}-{i}"
        )
        assert status == 200, answer
        answers[prompt] = text_of(answer)
    after: Mapping[str, dict[str, float]] = {
        "consumer": await metrics(http, consumer.url),
        "proxy": await metrics(http, proxy.url),
    }
    return Stage(
        deltas(after["consumer"], before["consumer"]),
        deltas(after["proxy"], before["proxy"]),
        consumer.log_count(FLIPPED) - flipped,
        answers,
    )


async def through_proxy_as_alone(
    http: aiohttp.ClientSession,
    servers: Servers,
    prompts: list[str],
    max_tokens: int,
    tag: str,
) -> Stage:
    """Each prompt answered by the producer alone, then through the proxy
    (:func:`through_proxy`): the answers must be the same."""
    expected = await local_answers(
        http, servers.engine(PRODUCER).url, prompts, max_tokens
    )
    stage = await through_proxy(http, servers, prompts, max_tokens, tag)
    assert stage.answers == expected
    return stage


def assert_caught_and_retried(stage: Stage, num_requests: int) -> None:
    """Every corrupted load was caught, failed and retried; every other load
    verified, none unverified."""
    assert stage.corrupted >= num_requests
    assert stage.count("checksum_mismatch") == stage.corrupted
    assert stage.count("load_failures") == stage.corrupted
    assert stage.integrity_retries == stage.corrupted
    verified = stage.count("checksum_verified")
    assert num_requests <= verified <= num_requests + stage.retries - stage.corrupted
    assert stage.consumer.get("kvguard_kv_checksum_unverified_total", 0.0) == 0
