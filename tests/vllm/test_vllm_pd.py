"""KVGuard in real vLLM 0.32 (CPU): vLLM instances doing P/D over
NixlConnector, the KVGuard proxy in front, clean and corrupted loads.

Every stage runs in both of KVGuard's modes (``mode``): with its scheduler
class (``--scheduler-cls``, same-step verdicts) and with the connector only
(a fail-closed load waits one engine step for its verdict). One producer
serves two consumers, one per mode, each behind its own proxy; the tests
restart only the instances whose configuration a stage changes, so they run
in this file's order.

What the tests assert is what KVGuard promises: every answer equals a
single instance's, every corrupted load is caught (as many mismatches as
the fault injector corrupted loads), and a caught load is retried or
recomputed. A loaded machine can make the proxy retry for other reasons
(a timeout, a reset connection): such retries are allowed, and counted
apart from the integrity retries the tests expect.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm_client import (
    MODEL_NAME,
    complete,
    deltas,
    error_message,
    metrics,
    post,
    prompts,
    stream_text,
    text_of,
)
from vllm_servers import WORK_DIR, EngineSpec, Servers, busy_threads

from engine_patch.aot_kernel import LOADED_FOR_A_SHAPE
from engine_patch.checksum_kernel import COMPILED_FOR_A_SHAPE
from engine_patch.payload import KVChecksumPayload
from proxy.body import PREFILL_KV_PARAMS
from tests.support.programs import ALERT_RULES, need, promtool
from tests.support.shapes import shape, sse_data

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(900),
]

# KVGuard's two modes: with its scheduler class, and the connector only.
MODES = {"scheduler-class": True, "connector-only": False}

KVGUARD_PRODUCER = EngineSpec("producer")
# Fail-closed, policy "fail", eager checksums (the default).
KVGUARD_CONSUMER = EngineSpec("consumer")
# Plain NIXL, kv_both as llm-d runs every instance: it can load KV too, which
# makes it the consumer without KVGuard that KVGuardConsumerWithoutKVGuard
# must name.
PLAIN_PRODUCER = EngineSpec("producer", connector="nixl", kv_both=True)

PROMPTS = prompts(12)
# Requests per corrupted-load stage.
FEW = 4
MAX_TOKENS = 12
NO_CHECKSUMS = "the producer sent no checksums"
FLIPPED = "Fault injection: flipped a bit"
INTEGRITY_RETRIES = "kvguard_proxy_retries_total{reason=kv_integrity}"

# The single-instance answers, by prompt: computed once, locally on the
# producer (a plain request prefills and decodes on one instance).
_references: dict[str, str] = {}


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def use(servers: Servers, producer: EngineSpec, consumer: EngineSpec) -> None:
    """The producer, a consumer per mode, and fresh proxies."""
    await servers.use(
        {
            "producer": producer,
            **{
                f"consumer-{mode}": replace(consumer, scheduler_class=flag)
                for mode, flag in MODES.items()
            },
        },
        {f"proxy-{mode}": ("producer", f"consumer-{mode}") for mode in MODES},
    )


def consumer_url(servers: Servers, mode: str) -> str:
    return servers.engine(f"consumer-{mode}").url


def proxy_url(servers: Servers, mode: str) -> str:
    return servers.proxy(f"proxy-{mode}").url


async def references(http: aiohttp.ClientSession, servers: Servers) -> dict[str, str]:
    if not _references:
        texts = {}
        for prompt in PROMPTS:
            status, answer = await complete(
                http, servers.engine("producer").url, prompt, max_tokens=MAX_TOKENS
            )
            assert status == 200, answer
            texts[prompt] = text_of(answer)
        # Not all the same text: the test would not see wrong KV otherwise.
        assert len(set(texts.values())) > len(PROMPTS) // 2
        _references.update(texts)
    return _references


async def prefill(
    http: aiohttp.ClientSession, servers: Servers, prompt: str, request_id: str
) -> dict[str, Any]:
    """A prefill as the proxy sends it; its kv_transfer_params."""
    status, answer = await complete(
        http,
        servers.engine("producer").url,
        prompt,
        max_tokens=1,
        request_id=request_id,
        kv_transfer_params=PREFILL_KV_PARAMS,
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return dict(params)


async def through_proxy(
    http: aiohttp.ClientSession, servers: Servers, mode: str, prompt: str, rid: str
) -> tuple[int, Any]:
    return await complete(
        http, proxy_url(servers, mode), prompt, max_tokens=MAX_TOKENS, request_id=rid
    )


async def prefix_cache_hits(
    http: aiohttp.ClientSession, servers: Servers, mode: str, texts: list[str]
) -> float:
    """The tokens the mode's consumer serves from its prefix cache to local
    requests (no KV load) of ``texts``."""
    url = consumer_url(servers, mode)
    before = await metrics(http, url)
    for text in texts:
        status, answer = await complete(http, url, text, max_tokens=1)
        assert status == 200, answer
    return deltas(await metrics(http, url), before).get(
        "vllm:prefix_cache_hits_total", 0.0
    )


class Changes:
    """Metric deltas of the producer, a mode's consumer and proxy, and what
    the consumer's fault injector logged, over a ``with`` block."""

    def __init__(
        self, http: aiohttp.ClientSession, servers: Servers, mode: str
    ) -> None:
        self._http = http
        self._servers = {
            "producer": servers.engine("producer"),
            "consumer": servers.engine(f"consumer-{mode}"),
            "proxy": servers.proxy(f"proxy-{mode}"),
        }
        self._before: dict[str, dict[str, float]] = {}
        self._flipped = 0
        self.producer: dict[str, float] = {}
        self.consumer: dict[str, float] = {}
        self.proxy: dict[str, float] = {}
        # Loads the fault injector corrupted.
        self.corrupted = 0

    async def __aenter__(self) -> Changes:
        for name, server in self._servers.items():
            self._before[name] = await metrics(self._http, server.url)
        self._flipped = self._servers["consumer"].log_count(FLIPPED)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for name, server in self._servers.items():
            after = await metrics(self._http, server.url)
            setattr(self, name, deltas(after, self._before[name]))
        self.corrupted = self._servers["consumer"].log_count(FLIPPED) - self._flipped

    def consumer_count(self, name: str) -> float:
        return self.consumer.get(f"kvguard_kv_{name}_total", 0.0)

    @property
    def retries(self) -> float:
        """The proxy's retries, whatever their reason."""
        return self.proxy.get("kvguard_proxy_retries_total", 0.0)

    @property
    def integrity_retries(self) -> float:
        return self.proxy.get(INTEGRITY_RETRIES, 0.0)


def assert_holds(change: Changes, mode: str) -> None:
    """Loads wait for their verdicts connector-only, never with the class."""
    held = change.consumer_count("loads_held")
    if MODES[mode]:
        assert held == 0
    else:
        assert held == change.consumer_count(
            "checksum_verified"
        ) + change.consumer_count("checksum_mismatch")


async def test_loads_from_a_producer_without_kvguard_are_unverified_and_fail(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    await use(servers, PLAIN_PRODUCER, KVGUARD_CONSUMER)
    async with Changes(http, servers, mode) as change:
        for i, prompt in enumerate(PROMPTS[:3]):
            params = await prefill(http, servers, prompt, f"plain-{mode}-{i}")
            assert "kv_checksums" not in params
            status, answer = await complete(
                http,
                consumer_url(servers, mode),
                prompt,
                max_tokens=MAX_TOKENS,
                request_id=f"plain-{mode}-{i}",
                kv_transfer_params=params,
            )
            assert status == 500, answer
            message = error_message(answer)
            assert "KV checksum mismatch" in message
            assert f"could not be verified: {NO_CHECKSUMS}" in message
    reason = f"kvguard_kv_checksum_unverified_total{{reason={NO_CHECKSUMS}}}"
    assert change.consumer.get(reason) == 3
    assert change.consumer_count("load_failures") == 3
    assert change.consumer_count("checksum_verified") == 0


def _alert_expr(name: str) -> str:
    groups = yaml.safe_load(ALERT_RULES.read_text())["groups"]
    return next(
        str(rule["expr"])
        for group in groups
        for rule in group["rules"]
        if rule.get("alert") == name
    )


def _series(name: str, labels: dict[str, str]) -> str:
    """A sample in promtool's series notation (label values JSON-quoted)."""
    return (
        name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in labels.items()) + "}"
    )


async def test_the_alert_on_consumers_without_kvguard_names_only_plain_nixl(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    """KVGuardConsumerWithoutKVGuard's expression over these engines' real
    /metrics, evaluated by promtool: the plain NIXL kv_both instance is named,
    KVGuard's consumers are not."""
    need("promtool", "prometheus")
    await use(servers, PLAIN_PRODUCER, KVGUARD_CONSUMER)
    expr = _alert_expr("KVGuardConsumerWithoutKVGuard")
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    input_series = []
    used: dict[str, set[str]] = {}
    for name in ["producer", *(f"consumer-{m}" for m in MODES)]:
        async with http.get(f"{servers.engine(name).url}/metrics") as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in names:
                    continue
                used.setdefault(name, set()).add(sample.name)
                labels = {**sample.labels, "job": "vllm", "instance": name}
                input_series.append(
                    {
                        "series": _series(sample.name, labels),
                        "values": f"{sample.value}x5",
                    }
                )
    # Both families the rule reads come from real vLLM on KVGuard's consumers.
    assert used["consumer-scheduler-class"] == {
        "vllm:num_requests_kv_fetch_by_stage",
        "kvguard_kv_checksum_verified_total",
    }
    assert used["producer"] == {"vllm:num_requests_kv_fetch_by_stage"}
    tests = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": '{job="vllm",instance="producer"}', "value": 1}
                        ],
                    }
                ],
            }
        ],
    }
    path = WORK_DIR / "consumer-alert.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    await asyncio.to_thread(promtool, "test", "rules", str(path))


async def test_no_thread_of_an_idle_instance_keeps_a_core_at_normal_priority(
    servers: Servers,
) -> None:
    # NIXL's progress thread polls without pause; left at nice 0, two of them
    # starve the engines of a 2-core machine (requests stalled ~30 s).
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    for server in servers.engines.values():
        assert server.process is not None
        busy = await asyncio.to_thread(busy_threads, server.process.pid)
        for tid in busy:
            assert os.getpriority(os.PRIO_PROCESS, tid) == 19, (server.name, tid)


async def test_prefill_returns_kv_checksums_in_kv_transfer_params(
    http: aiohttp.ClientSession, servers: Servers
) -> None:
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    params = await prefill(http, servers, PROMPTS[0], "params-0")
    payload = KVChecksumPayload.from_bytes(base64.b64decode(params["kv_checksums"]))
    assert payload.tp_size == 1
    assert payload.num_tokens == params["remote_num_tokens"]
    # One KV cache group (Llama), one checksum per transferred block.
    ((fingerprint, block_size, start, values),) = payload.groups.values()
    assert (block_size, start) == (32, 0)
    assert len(values) == len(params["remote_block_ids"][0])
    assert fingerprint != 0 and all(values)


async def all_match_through_proxy(
    http: aiohttp.ClientSession,
    servers: Servers,
    mode: str,
    expected: dict[str, str],
    name: str,
) -> None:
    """Every prompt through the mode's proxy, four at a time (request ids
    ``name-mode-i``): each answered 200 with the single instance's text."""
    limit = asyncio.Semaphore(4)

    async def one(i: int, prompt: str) -> None:
        async with limit:
            status, answer = await through_proxy(
                http, servers, mode, prompt, f"{name}-{mode}-{i}"
            )
        assert status == 200, answer
        assert text_of(answer) == expected[prompt], prompt

    await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(PROMPTS)))


async def test_clean_loads_through_the_proxy_verify_and_match_a_single_instance(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    expected = await references(http, servers)
    async with Changes(http, servers, mode) as change:
        await all_match_through_proxy(http, servers, mode, expected, "clean")
    verified = change.consumer_count("checksum_verified")
    # One verified load per request (and per retry that reached a load).
    assert len(PROMPTS) <= verified <= len(PROMPTS) + change.retries
    assert change.consumer_count("checksum_mismatch") == 0
    assert change.consumer.get("kvguard_kv_checksum_unverified_total", 0) == 0
    assert change.consumer_count("load_failures") == 0
    assert change.consumer_count("checksum_bytes") > 0
    assert change.producer.get("kvguard_kv_checksum_sent_total", 0) >= len(PROMPTS)
    assert change.integrity_retries == 0
    assert_holds(change, mode)
    # A clean load's KV serves later requests of its prompt.
    assert await prefix_cache_hits(http, servers, mode, PROMPTS[:FEW]) > 0


@pytest.mark.parametrize(
    "kind", ["choices", "prompts", "prompt-logprobs", "beam-search"]
)
async def test_requests_that_would_not_use_a_prefill_are_prefilled_on_the_decode(
    http: aiohttp.ClientSession, servers: Servers, mode: str, kind: str
) -> None:
    # Several choices would each pull the same prefill's KV; several prompts,
    # one longer than the prefill's, stop the decode's engine; a decode
    # computing prompt logprobs reads no KV it did not compute; a beam
    # search's steps carry no kv_transfer_params (docs/wire.md).
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    async with Changes(http, servers, mode) as change:
        for i, prompt in enumerate(PROMPTS[:FEW]):
            body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS}
            if kind == "choices":
                body.update(prompt=prompt, n=2, temperature=0.8, seed=i)
            elif kind == "prompts":
                body.update(prompt=[prompt, PROMPTS[-1 - i]], temperature=0)
            elif kind == "beam-search":
                body.update(prompt=prompt, use_beam_search=True, n=1)
            else:
                body.update(prompt=prompt, prompt_logprobs=1, temperature=0)
            url = f"{proxy_url(servers, mode)}/v1/completions"
            status, answer = await post(http, url, body, f"{kind}-{mode}-{i}")
            assert status == 200, answer
            several = kind in ("choices", "prompts")
            assert len(answer["choices"]) == (2 if several else 1)
    # The producer saw none of them.
    assert change.producer.get("vllm:prompt_tokens_total", 0) == 0
    assert change.producer.get("kvguard_kv_checksum_sent_total", 0) == 0
    for name in ("checksum_verified", "checksum_mismatch", "load_failures"):
        assert change.consumer_count(name) == 0, name
    assert change.retries == 0


# Fields only the decode leg reads (the prefill leg asks for one token and no
# stream), with values vLLM takes and values it refuses whatever the prompt;
# the servers' max_model_len is 512.
DECODE_FIELDS: dict[str, dict[str, Any]] = {
    "stream-options-without-stream": {"stream_options": {"include_usage": True}},
    "empty-stream-options": {"stream_options": {}},
    "stream-options-and-a-stream-string": {
        "stream": "false",
        "stream_options": {"include_usage": True},
    },
    "stream-options-not-an-object": {"stream": True, "stream_options": "yes"},
    "no-output": {"max_tokens": 0},
    "echo-without-generation": {"echo": True, "max_tokens": 0},
    "max-tokens-as-text": {"max_tokens": "3"},
    "max-tokens-not-a-number": {"max_tokens": "three"},
    "min-tokens-null": {"min_tokens": None},
    "min-tokens-above-max-tokens": {"max_tokens": 2, "min_tokens": 3},
    "min-tokens-above-the-default": {"min_tokens": 17},
    "min-tokens-equal-max-tokens": {"max_tokens": 3, "min_tokens": 3},
    "past-the-context": {"max_tokens": 513},
    "up-to-the-context": {"max_tokens": 512, "stop": ["."]},
}


async def test_the_proxy_refuses_before_the_prefill_what_the_decode_refuses(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    # vLLM would refuse these on the decode only, after the prefill ran and
    # left KV held until its lease ends (docs/wire.md).
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    differ = {}
    for name, fields in DECODE_FIELDS.items():
        body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "temperature": 0}
        body.update(fields)
        url = f"{consumer_url(servers, mode)}/v1/completions"
        vllm_status, vllm_answer = await post(http, url, body, f"{name}-direct")
        async with Changes(http, servers, mode) as change:
            url = f"{proxy_url(servers, mode)}/v1/completions"
            status, answer = await post(http, url, body, f"{name}-{mode}")
        prefilled = change.producer.get("kvguard_kv_checksum_sent_total", 0)
        if status != vllm_status:
            differ[name] = f"vLLM {vllm_status} {vllm_answer}, proxy {status} {answer}"
        elif status == 400 and prefilled:
            differ[name] = "refused by the decode after a prefill"
    assert not differ, "\n".join(f"{name}: {why}" for name, why in differ.items())


async def test_structured_outputs_vllm_fails_with_500_get_a_400_from_the_proxy(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    # vLLM's validator calls .get on them before their type is checked.
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "structured_outputs": []}
    url = f"{consumer_url(servers, mode)}/v1/completions"
    status, answer = await post(http, url, body, f"structured-direct-{mode}")
    assert (status, answer["error"]["type"]) == (500, "InternalServerError")
    async with Changes(http, servers, mode) as change:
        url = f"{proxy_url(servers, mode)}/v1/completions"
        status, answer = await post(http, url, body, f"structured-{mode}")
    assert status == 400
    assert answer["error"]["param"] == "structured_outputs"
    assert change.producer.get("vllm:prompt_tokens_total", 0) == 0
    assert change.retries == 0


async def test_a_non_stream_answer_assembled_from_batched_chunks_is_a_single_instances(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    # The proxy asks the decode of a non-streaming request for chunks of 16
    # tokens after the first (stream_interval), and joins them.
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPTS[1],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_interval": 4,
        "return_token_ids": True,
    }
    url = f"{consumer_url(servers, mode)}/v1/completions"
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        raw = (await response.read()).decode()
    events = sse_data(raw)
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    # As the fake engine batches them: the first at once, the last at the end.
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 4, 4, 1]
    del body["stream"], body["stream_interval"], body["return_token_ids"]
    body["max_tokens"] = 40
    status, want = await post(
        http, f"{servers.engine('producer').url}/v1/completions", body
    )
    assert status == 200, want
    status, got = await post(http, f"{proxy_url(servers, mode)}/v1/completions", body)
    assert status == 200, got
    assert text_of(got) == text_of(want)
    assert got["usage"]["completion_tokens"] == 40


CHAT = "/v1/chat/completions"
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": PROMPTS[2]},
]
# Non-streaming bodies (the proxy assembles most from the decode's stream):
# path and fields beside the model and temperature 0.
WHOLE_ANSWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("/v1/completions", {}),
    "logprobs": ("/v1/completions", {"logprobs": 2}),
    "echo": ("/v1/completions", {"echo": True}),
    "echo-logprobs": ("/v1/completions", {"echo": True, "logprobs": 1}),
    "echo-token-ids": ("/v1/completions", {"echo": True, "return_token_ids": True}),
    "token-ids": ("/v1/completions", {"return_token_ids": True}),
    "prompt-logprobs-0": ("/v1/completions", {"prompt_logprobs": 0}),
    "prompt-logprobs": ("/v1/completions", {"prompt_logprobs": 1}),
    "stop": ("/v1/completions", {"stop": ["e"], "include_stop_str_in_output": True}),
    "sampled": ("/v1/completions", {"temperature": 0.9, "seed": 7}),
    "regex": ("/v1/completions", {"structured_outputs": {"regex": "[a-c]{5}"}}),
    "echo-without-generation": ("/v1/completions", {"echo": True, "max_tokens": 0}),
    "truncated": ("/v1/completions", {"truncate_prompt_tokens": 10}),
    # Prefilled on the decode (docs/wire.md, "Several choices or prompts").
    "choices": ("/v1/completions", {"n": 2, "temperature": 0.8, "seed": 1}),
    "prompts": ("/v1/completions", {"prompt": [PROMPTS[3], PROMPTS[4]]}),
    "chat": (CHAT, {}),
    "chat-max-completion-tokens": (CHAT, {"max_completion_tokens": 5}),
    "chat-logprobs": (CHAT, {"logprobs": True, "top_logprobs": 2}),
    "chat-echo": (CHAT, {"echo": True}),
    "chat-token-ids": (CHAT, {"return_token_ids": True}),
    "chat-json": (CHAT, {"response_format": {"type": "json_object"}}),
    "chat-schema": (
        CHAT,
        {
            "max_tokens": 20,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}},
                        "required": ["a"],
                    },
                },
            },
        },
    ),
    "chat-choices": (CHAT, {"n": 2, "temperature": 0.8, "seed": 1}),
    "chat-sampled": (CHAT, {"temperature": 0.7, "seed": 3}),
    "chat-continued": (
        CHAT,
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
}
# Differ from call to call.
VOLATILE = frozenset({"id", "created"})
# A field one answer lacks.
ABSENT = "<absent>"


def compared_body(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A body sent to a single instance and through the proxy: 8 greedy
    tokens of one prompt (a chat's messages), then ``fields``."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": PROMPTS[3]})
    body.update(fields)
    return body


def _unlike(want: Any, got: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want``; a field absent from one and null
    in the other differs too."""
    if isinstance(want, dict) and isinstance(got, dict):
        return [
            line
            for key in sorted((set(want) | set(got)) - VOLATILE)
            for line in _unlike(
                want.get(key, ABSENT), got.get(key, ABSENT), f"{path}.{key}"
            )
        ]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [
            line
            for i, (w, g) in enumerate(zip(want, got, strict=True))
            for line in _unlike(w, g, f"{path}[{i}]")
        ]
    if want != got:
        return [f"{path}: vLLM {json.dumps(want)[:120]}, proxy {json.dumps(got)[:120]}"]
    return []


async def test_whole_non_stream_answers_through_the_proxy_are_a_single_instances(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    differ = {}
    for name, (path, fields) in WHOLE_ANSWERS.items():
        body = compared_body(path, fields)
        url = servers.engine("producer").url + path
        status, want = await post(http, url, body, f"{name}-single")
        assert status == 200, want
        url = proxy_url(servers, mode) + path
        status, got = await post(http, url, body, f"{name}-{mode}")
        assert status == 200, got
        if lines := _unlike(want, got):
            differ[name] = "\n  ".join(lines)
    assert not differ, "\n".join(f"{name}:\n  {why}" for name, why in differ.items())


# Streaming bodies: path and fields beside the model, temperature 0 and
# ``stream``.
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("/v1/completions", {}),
    "usage": ("/v1/completions", {"stream_options": {"include_usage": True}}),
    "continuous-usage": (
        "/v1/completions",
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    "logprobs": ("/v1/completions", {"logprobs": 2}),
    "echo": ("/v1/completions", {"echo": True}),
    "token-ids": ("/v1/completions", {"return_token_ids": True}),
    "stop": ("/v1/completions", {"stop": ["e"], "include_stop_str_in_output": True}),
    "interval": ("/v1/completions", {"stream_interval": 3}),
    # Prefilled on the decode (docs/wire.md, "Several choices or prompts").
    "choices": ("/v1/completions", {"n": 2, "temperature": 0.8, "seed": 1}),
    "prompts": ("/v1/completions", {"prompt": [PROMPTS[3], PROMPTS[4]]}),
    "chat": (CHAT, {}),
    "chat-usage": (CHAT, {"stream_options": {"include_usage": True}}),
    "chat-logprobs": (CHAT, {"logprobs": True, "top_logprobs": 2}),
    "chat-token-ids": (CHAT, {"return_token_ids": True}),
    "chat-json": (CHAT, {"response_format": {"type": "json_object"}}),
}


async def stream_of(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> dict[str, Any]:
    """A stream's status and what must match a single instance's: per
    choice its joined text, token ids and logprobs, and its finish; the last
    chunk's usage; the first event's shape, the last one's and the set of
    all. Nothing depends on how many chunks carry the tokens (vLLM joins
    several steps' chunks when its server falls behind), nor on the order in
    which several choices finish."""
    async with http.post(url, json=body) as response:
        text = await response.text()
        if response.status != 200:
            return {"status": response.status, "body": text}
    events = sse_data(text)
    assert events[-1] == "[DONE]", events[-1:]
    chunks = [json.loads(e) for e in events[:-1]]
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            into = choices.setdefault(
                choice["index"], {"text": "", "token_ids": [], "logprobs": {}}
            )
            delta = choice.get("delta", choice)
            into["text"] += delta.get("text") or delta.get("content") or ""
            into["token_ids"] += choice.get("token_ids") or []
            # Completions: lists per token; chat: ``content``, a list.
            for key, values in (choice.get("logprobs") or {}).items():
                into["logprobs"].setdefault(key, []).extend(values or [])
            for key in ("finish_reason", "stop_reason", "prompt_token_ids"):
                if choice.get(key) is not None:
                    into[key] = choice[key]
    shapes = [json.dumps(shape(c), sort_keys=True) for c in chunks]
    return {
        "status": 200,
        "choices": choices,
        "usage": chunks[-1].get("usage"),
        "first": shapes[0],
        "last": shapes[-1],
        "all": sorted(set(shapes)),
    }


async def test_streams_through_the_proxy_are_a_single_instances(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    await use(servers, KVGUARD_PRODUCER, KVGUARD_CONSUMER)
    differ = {}
    for name, (path, fields) in STREAMS.items():
        body = compared_body(path, {"stream": True, **fields})
        want = await stream_of(http, servers.engine("producer").url + path, body)
        assert want["status"] == 200, want
        got = await stream_of(http, proxy_url(servers, mode) + path, body)
        if lines := _unlike(want, got):
            differ[name] = "\n  ".join(lines)
    assert not differ, "\n".join(f"{name}:\n  {why}" for name, why in differ.items())


async def test_a_compiled_consumer_verifies_clean_loads_and_compiles_only_at_start(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    # The fused kernel ("compile": true) is compiled (or loaded, once built)
    # while vLLM starts; loads of every size then run its code. A compile in
    # an engine step would stall the engine for seconds, and past a
    # producer's 30 s KV lease its blocks can be reused before the pull.
    await use(servers, KVGUARD_PRODUCER, replace(KVGUARD_CONSUMER, compile=True))
    consumer = servers.engine(f"consumer-{mode}")

    def kernels_prepared() -> int:
        return consumer.log_count(COMPILED_FOR_A_SHAPE) + consumer.log_count(
            LOADED_FOR_A_SHAPE
        )

    compiles_at_start = kernels_prepared()
    assert compiles_at_start > 0, consumer.log_tail()
    expected = await references(http, servers)
    async with Changes(http, servers, mode) as change:
        await all_match_through_proxy(http, servers, mode, expected, "compiled")
    assert change.consumer_count("checksum_verified") >= len(PROMPTS)
    assert change.consumer_count("checksum_mismatch") == 0
    assert change.consumer.get("kvguard_kv_checksum_unverified_total", 0) == 0
    assert change.integrity_retries == 0
    assert kernels_prepared() == compiles_at_start


async def test_corrupted_loads_fail_open_are_counted_and_answered(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    consumer_spec = EngineSpec(
        "consumer", "faults", fail_closed=False, faults=(("loads", "all"),)
    )
    await use(servers, KVGUARD_PRODUCER, consumer_spec)
    async with Changes(http, servers, mode) as change:
        for i, prompt in enumerate(PROMPTS[:FEW]):
            status, answer = await through_proxy(
                http, servers, mode, prompt, f"open-{mode}-{i}"
            )
            assert status == 200, answer
            assert text_of(answer)
    assert change.corrupted >= FEW
    assert change.consumer_count("checksum_mismatch") == change.corrupted
    assert change.consumer_count("checksum_verified") == 0
    assert change.consumer_count("load_failures") == 0
    # Fail-open holds no load for its verdict, in either mode.
    assert change.consumer_count("loads_held") == 0
    assert change.integrity_retries == 0
    # But a mismatched load's KV never serves another request.
    assert await prefix_cache_hits(http, servers, mode, PROMPTS[:FEW]) == 0


async def test_corrupted_load_is_retried_on_another_prefill_and_answers_clean_text(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    # Every other load corrupted: each request's first attempt fails, its
    # retry (a new prefill and load) is clean.
    consumer_spec = EngineSpec(
        "consumer", "faults", policy="fail", faults=(("loads", "every_other"),)
    )
    await use(servers, KVGUARD_PRODUCER, consumer_spec)
    expected = await references(http, servers)
    async with Changes(http, servers, mode) as change:
        for i, prompt in enumerate(PROMPTS[:FEW]):
            status, answer = await through_proxy(
                http, servers, mode, prompt, f"retry-{mode}-{i}"
            )
            assert status == 200, answer
            assert text_of(answer) == expected[prompt]
        # Streamed, the retry happens before the client's first byte too.
        prompt = PROMPTS[FEW]
        text = await stream_text(
            http,
            proxy_url(servers, mode),
            prompt,
            max_tokens=MAX_TOKENS,
            request_id=f"retry-{mode}-stream",
        )
        assert text == expected[prompt]
    # Every corrupted load caught, failed and retried.
    assert change.corrupted >= FEW + 1
    assert change.consumer_count("checksum_mismatch") == change.corrupted
    assert change.consumer_count("load_failures") == change.corrupted
    assert change.consumer.get("kvguard_kv_checksum_unverified_total", 0) == 0
    assert change.integrity_retries == change.corrupted
    assert (
        change.proxy.get("kvguard_proxy_kv_integrity_failures_total")
        == change.corrupted
    )
    verified = change.consumer_count("checksum_verified")
    assert FEW + 1 <= verified <= FEW + 1 + change.retries
    assert_holds(change, mode)


async def test_corrupted_loads_recompute_locally_and_answer_clean_text(
    http: aiohttp.ClientSession, servers: Servers, mode: str
) -> None:
    consumer_spec = EngineSpec(
        "consumer", "faults", policy="recompute", faults=(("loads", "all"),)
    )
    await use(servers, KVGUARD_PRODUCER, consumer_spec)
    expected = await references(http, servers)
    async with Changes(http, servers, mode) as change:
        for i, prompt in enumerate(PROMPTS[:FEW]):
            status, answer = await through_proxy(
                http, servers, mode, prompt, f"recompute-{mode}-{i}"
            )
            assert status == 200, answer
            assert text_of(answer) == expected[prompt]
    assert change.corrupted >= FEW
    assert change.consumer_count("checksum_mismatch") == change.corrupted
    assert change.consumer_count("load_failures") == change.corrupted
    # The consumer recomputes: nothing for the proxy to retry.
    assert change.integrity_retries == 0
    assert_holds(change, mode)
