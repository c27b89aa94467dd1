"""The fake engine answers like vLLM 0.32 on the wire: the same bodies get
the same statuses, and answers and stream events of the same shape (keys,
and the JSON type of each value; the models and so the texts differ).

The proxy's tests run against fake engines; a field or an error vLLM sends
and the fake engine does not would leave the proxy's handling of it
untested (an echo's prompt token ids in a stream were one). The rules the
fake engine copies from vLLM's sampler and detokenizer (stop tokens, EOS,
``min_tokens``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``) are
checked on both engines' own greedy outputs.
"""

from __future__ import annotations

import ast
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from vllm_client import MODEL_NAME, post
from vllm_servers import EngineSpec, Servers

from fake_engine.config import EngineConfig, Role
from fake_engine.testing import fake_engines
from fake_engine.tokenizer import EOS_TOKEN_ID
from proxy.body import PREFILL_KV_PARAMS
from tests.support.shapes import filled, shape, sse_data

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(600),
]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog, then it"
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
OTHER_PROMPT = "Foxes live in"
SAMPLED_PAIR = {"n": 2, "temperature": 0.8, "seed": 1}
BEAMS = {"use_beam_search": True, "n": 2}
# Tokens to score at each generated position (in both vocabularies), one
# listed twice.
TOKEN_IDS = {"logprob_token_ids": [100, 200, 100]}
# The tiny model's EOS (scripts/make_tiny_model.py).
TINY_EOS_TOKEN_ID = 1
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CONVERSATION = [*MESSAGES, {"role": "assistant", "content": "Foxes"}]
# Past both vocabularies (the tiny model's 512, the fake engine's 257).
OUT_OF_VOCAB = 600

# Fields both routes take, the same way.
SHARED: dict[str, dict[str, Any]] = {
    "": {},
    "-token-ids": {"return_token_ids": True},
    "-stream": {"stream": True},
    "-stream-usage": {"stream": True, "stream_options": {"include_usage": True}},
    "-stream-continuous-usage": {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "-stream-token-ids": {"stream": True, "return_token_ids": True},
}
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"completion{name}": (COMPLETIONS, f) for name, f in SHARED.items()},
    **{f"chat{name}": (CHAT, f) for name, f in SHARED.items()},
    "completion-echo": (COMPLETIONS, {"echo": True}),
    "completion-echo-token-ids": (
        COMPLETIONS,
        {"echo": True, "return_token_ids": True},
    ),
    "completion-stream-echo": (COMPLETIONS, {"stream": True, "echo": True}),
    # Echoes without generation: the prompt alone, after one token sampled.
    "completion-echo-without-generation": (
        COMPLETIONS,
        {"echo": True, "max_tokens": 0, "logprobs": 1, "return_token_ids": True},
    ),
    "completion-stream-echo-without-generation": (
        COMPLETIONS,
        {
            "echo": True,
            "max_tokens": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    # Several choices, several prompts: a request of each runs as several.
    "completion-choices": (COMPLETIONS, SAMPLED_PAIR),
    "completion-stream-choices": (
        COMPLETIONS,
        {**SAMPLED_PAIR, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "completion-prompts": (COMPLETIONS, {"prompt": [PROMPT, OTHER_PROMPT]}),
    "completion-stream-prompts": (
        COMPLETIONS,
        {
            "prompt": [PROMPT, OTHER_PROMPT],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "chat-choices": (CHAT, SAMPLED_PAIR),
    "chat-stream-choices": (CHAT, {**SAMPLED_PAIR, "stream": True}),
    # Beam search: the beams are the choices.
    "completion-beam": (COMPLETIONS, BEAMS),
    "completion-beam-logprobs": (COMPLETIONS, {**BEAMS, "logprobs": 1}),
    # Neither checked nor applied by a beam search.
    "completion-beam-steering": (
        COMPLETIONS,
        {
            **BEAMS,
            "logit_bias": {"x": 1},
            "allowed_token_ids": [],
            "stop_token_ids": [OUT_OF_VOCAB],
            "bad_words": [""],
        },
    ),
    "chat-beam": (CHAT, BEAMS),
    "chat-stream-beam": (CHAT, {**BEAMS, "stream": True}),
    # Logprobs: of each token, of the prompt's.
    "completion-logprobs": (COMPLETIONS, {"logprobs": 2}),
    "completion-stream-logprobs": (COMPLETIONS, {"stream": True, "logprobs": 2}),
    "completion-echo-logprobs": (COMPLETIONS, {"echo": True, "logprobs": 1}),
    "completion-stream-echo-logprobs": (
        COMPLETIONS,
        {"stream": True, "echo": True, "logprobs": 0},
    ),
    "completion-prompt-logprobs": (COMPLETIONS, {"prompt_logprobs": 1}),
    "chat-logprobs": (CHAT, {"logprobs": True, "top_logprobs": 2}),
    "chat-stream-logprobs": (CHAT, {"stream": True, "logprobs": True}),
    "chat-prompt-logprobs": (CHAT, {"prompt_logprobs": 2}),
    "completion-logprobs-as-ids": (
        COMPLETIONS,
        {"logprobs": 1, "return_tokens_as_token_ids": True},
    ),
    "chat-stream-logprobs-as-ids": (
        CHAT,
        {"stream": True, "logprobs": True, "return_tokens_as_token_ids": True},
    ),
    # Logprobs of chosen tokens (prompt_logprob_token_ids: no field of
    # vLLM's OpenAI requests, ignored).
    "completion-logprob-token-ids": (COMPLETIONS, {**TOKEN_IDS, "logprobs": 1}),
    "completion-stream-logprob-token-ids": (
        COMPLETIONS,
        {**TOKEN_IDS, "logprobs": 0, "stream": True},
    ),
    "completion-echo-logprob-token-ids": (
        COMPLETIONS,
        {**TOKEN_IDS, "logprobs": 1, "echo": True, "prompt_logprobs": 3},
    ),
    "completion-logprob-token-ids-past-max-logprobs": (
        COMPLETIONS,
        {**TOKEN_IDS, "logprobs": 50},
    ),
    "chat-logprob-token-ids": (CHAT, {**TOKEN_IDS, "logprobs": True}),
    "chat-stream-logprob-token-ids": (
        CHAT,
        {**TOKEN_IDS, "logprobs": True, "top_logprobs": 1, "stream": True},
    ),
    "completion-prompt-logprob-token-ids": (
        COMPLETIONS,
        {"prompt_logprob_token_ids": [[1, 2]]},
    ),
    # Refused.
    "no-output": (COMPLETIONS, {"max_tokens": 0}),
    "stream-no-output": (COMPLETIONS, {"stream": True, "max_tokens": 0}),
    "negative-temperature": (COMPLETIONS, {"temperature": -1}),
    "top-p-0": (CHAT, {"top_p": 0}),
    "min-tokens-above-max-tokens": (CHAT, {"max_tokens": 2, "min_tokens": 3}),
    "stream-options-without-stream": (
        CHAT,
        {"stream_options": {"include_usage": True}},
    ),
    "no-messages": (CHAT, {"messages": None}),
    "unknown-model": (COMPLETIONS, {"model": "no-such-model"}),
    "greedy-choices": (COMPLETIONS, {"n": 2}),
    "too-many-logprobs": (COMPLETIONS, {"logprobs": 21}),
    "stream-beam": (COMPLETIONS, {**BEAMS, "stream": True}),
    "beam-echo-logprobs": (COMPLETIONS, {**BEAMS, "echo": True, "logprobs": 1}),
    "wide-beam": (COMPLETIONS, {**BEAMS, "n": 11}),
    "all-prompt-logprobs": (CHAT, {"prompt_logprobs": -1}),
    "negative-logprobs": (COMPLETIONS, {"logprobs": -2}),
    "text-prompt-logprobs": (COMPLETIONS, {"prompt_logprobs": "1"}),
    "top-logprobs-without-logprobs": (CHAT, {"top_logprobs": 2}),
    "stream-prompt-logprobs": (COMPLETIONS, {"stream": True, "prompt_logprobs": 1}),
    "no-choices": (CHAT, {"n": 0}),
    "logprob-token-ids-without-logprobs": (CHAT, TOKEN_IDS),
    "completion-logprob-token-ids-without-logprobs": (COMPLETIONS, TOKEN_IDS),
    "beam-logprob-token-ids": (CHAT, {**BEAMS, **TOKEN_IDS, "logprobs": True}),
    "echo-no-output-logprob-token-ids": (
        COMPLETIONS,
        {**TOKEN_IDS, "echo": True, "max_tokens": 0, "logprobs": 1},
    ),
    "out-of-vocab-logprob-token-ids": (
        COMPLETIONS,
        {"logprobs": 1, "logprob_token_ids": [-1, 5]},
    ),
    "too-many-logprob-token-ids": (
        CHAT,
        {"logprobs": True, "logprob_token_ids": list(range(129))},
    ),
    "logit-bias-key-no-integer": (COMPLETIONS, {"logit_bias": {"x": 1, "7": 1}}),
    "logit-bias-key-before-n": (COMPLETIONS, {"n": 0, "logit_bias": {"x": 1}}),
    "out-of-vocab-logit-bias": (CHAT, {"logit_bias": {str(OUT_OF_VOCAB): 1}}),
    "out-of-vocab-stop-token-ids": (COMPLETIONS, {"stop_token_ids": [OUT_OF_VOCAB]}),
    "empty-allowed-token-ids": (CHAT, {"allowed_token_ids": []}),
    "empty-bad-word": (COMPLETIONS, {"bad_words": ["a", ""]}),
    "empty-bad-word-before-greedy-n": (
        COMPLETIONS,
        {"bad_words": [""], "temperature": 0, "n": 2},
    ),
    "blank-bad-word-after-logit-bias": (
        CHAT,
        {"bad_words": ["  "], "logit_bias": {str(OUT_OF_VOCAB): 1}},
    ),
    "blank-bad-word": (CHAT, {"bad_words": ["  "]}),
    "too-many-bad-words": (COMPLETIONS, {"bad_words": [str(i) for i in range(129)]}),
    "out-of-vocab-allowed-token-ids": (
        COMPLETIONS,
        {"allowed_token_ids": [5, OUT_OF_VOCAB]},
    ),
    "suffix": (COMPLETIONS, {"suffix": "x"}),
    "prompt-embeds": (COMPLETIONS, {"prompt_embeds": "AAAA"}),
    "no-prompts": (COMPLETIONS, {"prompt": []}),
    "too-many-prompts": (COMPLETIONS, {"prompt": ["x"] * 1025}),
    "empty-cache-salt": (CHAT, {"cache_salt": ""}),
    "five-stop-strings": (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}),
    "truncation-past-the-context": (CHAT, {"truncate_prompt_tokens": 600}),
    "truncation-below-minus-one": (COMPLETIONS, {"truncate_prompt_tokens": -2}),
    "truncated-to-nothing": (COMPLETIONS, {"truncate_prompt_tokens": 0}),
    "tools": (CHAT, {"tools": TOOLS}),
    "required-tool": (CHAT, {"tools": TOOLS, "tool_choice": "required"}),
    "tool-choice-without-tools": (CHAT, {"tool_choice": "auto"}),
    "chat-template": (CHAT, {"chat_template": "{{ x }}"}),
    "image": (CHAT, {"messages": [{"role": "user", "content": [IMAGE]}]}),
    "empty-conversation": (CHAT, {"messages": []}),
    "continuation-beside-the-generation-prompt": (
        CHAT,
        {"messages": CONVERSATION, "continue_final_message": True},
    ),
    # Taken.
    "truncated": (COMPLETIONS, {"truncate_prompt_tokens": 3, "return_token_ids": True}),
    "tools-not-to-call": (CHAT, {"tools": TOOLS, "tool_choice": "none"}),
    "continuation": (
        CHAT,
        {
            "messages": CONVERSATION,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    "cache-salt": (CHAT, {"cache_salt": "abc"}),
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake() -> AsyncIterator[str]:
    config = EngineConfig(model=MODEL_NAME, max_model_len=512)
    async with fake_engines(config) as (url,):
        yield url


async def answer(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, Any]:
    """The status and the answer's shape: of the JSON body, or of a stream
    as its first event, its last two and the set of all (vLLM may join the
    chunks of several steps when its server falls behind, so how many
    events have a shape is not compared)."""
    async with http.post(url, json=body) as response:
        text = await response.text()
        status = response.status
    if not (body.get("stream") and status == 200):
        return status, shape(json.loads(text))
    events = sse_data(text)
    shapes = [e if e == "[DONE]" else shape(json.loads(e)) for e in events]
    # A token whose text is empty has no bytes: its event's shape is
    # completed from the others'.
    shapes = [filled(s, shapes) for s in shapes]
    return status, (shapes[0], shapes[-2:], sorted(set(map(repr, shapes))))


def in_between(shape_repr: str, first: Any) -> bool:
    """Whether an event of this shape is a chunk of tokens that neither
    opens the stream (``first``) nor ends its choice: one vLLM's joining of
    steps can leave none of."""
    if shape_repr == repr(first):
        return False
    event = ast.literal_eval(shape_repr)
    if not isinstance(event, dict) or not event.get("choices"):
        return False
    (choice,) = event["choices"]
    return choice["finish_reason"] == "NoneType" and "role" not in choice.get(
        "delta", {}
    )


def same_answers(got: tuple[int, Any], want: tuple[int, Any]) -> bool:
    """Whether the fake engine's answer has vLLM's shape. A stream may have
    shapes vLLM's lacks only where vLLM joined every chunk between its
    first event and its last two into them."""
    if got == want:
        return True
    if not (isinstance(got[1], tuple) and isinstance(want[1], tuple)):
        return False
    (got_first, got_last, got_all), (want_first, want_last, want_all) = (
        got[1],
        want[1],
    )
    extra = set(got_all) - set(want_all)
    return (
        got[0] == want[0]
        and (got_first, got_last) == (want_first, want_last)
        and set(want_all) <= set(got_all)
        and all(in_between(e, want_first) for e in extra)
        and not any(in_between(e, want_first) for e in want_all)
    )


@pytest.mark.parametrize(("path", "fields"), BODIES.values(), ids=BODIES.keys())
async def test_the_fake_engine_answers_in_vllms_shape(
    http: aiohttp.ClientSession,
    servers: Servers,
    fake: str,
    path: str,
    fields: dict[str, Any],
) -> None:
    await servers.use({"producer": EngineSpec("producer")})
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT})
    body.update(fields)
    if body.get("messages") is None:
        body.pop("messages", None)
    want = await answer(http, servers.engine("producer").url + path, body)
    got = await answer(http, fake + path, body)
    assert same_answers(got, want), (got, want)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fake_producer() -> AsyncIterator[str]:
    config = EngineConfig(model=MODEL_NAME, max_model_len=512, role=Role.PRODUCER)
    async with fake_engines(config) as (url,):
        yield url


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completion", "chat"])
async def test_a_prefill_answers_in_vllms_shape(
    http: aiohttp.ClientSession, servers: Servers, fake_producer: str, path: str
) -> None:
    # As the proxy asks for it: the kv_transfer_params the decode is given,
    # checksums included, have the same keys and types.
    await servers.use({"producer": EngineSpec("producer")})
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": 1,
        "kv_transfer_params": PREFILL_KV_PARAMS,
    }
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT})
    want = await answer(http, servers.engine("producer").url + path, body)
    got = await answer(http, fake_producer + path, body)
    assert got == want
    assert "kv_checksums" in want[1]["kv_transfer_params"]


# Routes without a body: the model list the proxy reads max_model_len from,
# the health checks, the version; and routes vLLM does not serve.
PLAIN_ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/version"),
    ("GET", "/v1/models/" + MODEL_NAME),
    ("POST", "/v1/models"),
    ("GET", "/v1/completions"),
]


async def test_the_fake_engine_serves_vllms_plain_routes_alike(
    http: aiohttp.ClientSession, servers: Servers, fake: str
) -> None:
    await servers.use({"producer": EngineSpec("producer")})
    answers = {}
    for name, url in (("vllm", servers.engine("producer").url), ("fake", fake)):
        for method, path in PLAIN_ROUTES:
            async with http.request(method, url + path) as response:
                text = await response.text()
                kind = response.headers.get("Content-Type")
                answers[name, method, path] = (
                    response.status,
                    kind,
                    shape(json.loads(text)) if text else text,
                )
    for method, path in PLAIN_ROUTES:
        assert answers["fake", method, path] == answers["vllm", method, path], path


# Bodies of /tokenize and /detokenize, and bodies that are no JSON object:
# what vLLM takes is answered in its shape (the vocabularies differ, so the
# ids do), and what it refuses, in its words; the same below.
TOKENIZE_BODIES: dict[str, tuple[str, Any]] = {
    "prompt": ("/tokenize", {"prompt": PROMPT}),
    "prompt-model": ("/tokenize", {"model": MODEL_NAME, "prompt": PROMPT}),
    "prompt-strs": ("/tokenize", {"prompt": PROMPT, "return_token_strs": True}),
    "prompt-empty": ("/tokenize", {"prompt": ""}),
    "prompt-past-context": ("/tokenize", {"prompt": "ab " * 600}),
    "chat": ("/tokenize", {"messages": MESSAGES}),
    "chat-strs": ("/tokenize", {"messages": MESSAGES, "return_token_strs": True}),
    "chat-tools": ("/tokenize", {"messages": MESSAGES, "tools": TOOLS}),
    "chat-continued": (
        "/tokenize",
        {
            "messages": CONVERSATION,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
    "chat-both-flags": (
        "/tokenize",
        {
            "messages": CONVERSATION,
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
    ),
    "chat-continued-default": (
        "/tokenize",
        {"messages": CONVERSATION, "continue_final_message": True},
    ),
    "chat-empty": ("/tokenize", {"messages": []}),
    "chat-template": ("/tokenize", {"messages": MESSAGES, "chat_template": "x"}),
    "chat-image": (
        "/tokenize",
        {"messages": [{"role": "user", "content": [IMAGE]}]},
    ),
    "prompt-and-chat": ("/tokenize", {"prompt": "x", "messages": MESSAGES}),
    "neither": ("/tokenize", {}),
    "prompt-ids": ("/tokenize", {"prompt": [1, 2]}),
    "tokenize-unknown-model": ("/tokenize", {"model": "nope", "prompt": "x"}),
    "tokenize-list": ("/tokenize", [1]),
    "detokenize": ("/detokenize", {"tokens": [72, 101, 108]}),
    "detokenize-empty": ("/detokenize", {"tokens": []}),
    "detokenize-eos": ("/detokenize", {"tokens": [TINY_EOS_TOKEN_ID]}),
    "detokenize-out-of-vocab": ("/detokenize", {"tokens": [OUT_OF_VOCAB]}),
    "detokenize-negative": ("/detokenize", {"tokens": [-1]}),
    "detokenize-past-int64": ("/detokenize", {"tokens": [2**63]}),
    "detokenize-none": ("/detokenize", {}),
    "detokenize-unknown-model": ("/detokenize", {"model": "nope", "tokens": [1]}),
    "completion-list": (COMPLETIONS, [1]),
    "chat-list": (CHAT, [1]),
}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# Structured-output fields vLLM checks before compiling a grammar (the fake
# engine takes what only the grammar backend refuses, and cannot apply a
# constraint).
STRUCTURED_FIELDS: dict[str, tuple[str, dict[str, Any]]] = {
    "text": (CHAT, {"response_format": {"type": "text"}}),
    "json-mode": (CHAT, {"response_format": {"type": "json_object"}}),
    "json-mode-completion": (COMPLETIONS, {"response_format": {"type": "json_object"}}),
    "json-schema": (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
    ),
    "json-schema-without-its-object": (
        CHAT,
        {"response_format": {"type": "json_schema"}},
    ),
    "json-schema-without-a-schema": (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    ),
    "json-schema-without-a-name": (
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
    ),
    "unknown-format-type": (COMPLETIONS, {"response_format": {"type": "yaml"}}),
    "format-without-type": (CHAT, {"response_format": {}}),
    "format-not-an-object": (CHAT, {"response_format": "json"}),
    "choice": (CHAT, {"structured_outputs": {"choice": ["yes", "no"]}}),
    "regex": (COMPLETIONS, {"structured_outputs": {"regex": "[a-z]+"}}),
    "json": (COMPLETIONS, {"structured_outputs": {"json": SCHEMA}}),
    "two-constraints": (
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    ),
    "two-constraints-chat": (
        CHAT,
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    ),
    "a-regex-and-a-grammar": (
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "grammar": "root ::= 'a'"}},
    ),
    "no-constraint": (
        COMPLETIONS,
        {"structured_outputs": {"disable_any_whitespace": True, "nope": 1}},
    ),
    "a-regex-and-json-mode": (
        CHAT,
        {
            "structured_outputs": {"regex": "a"},
            "response_format": {"type": "json_object"},
        },
    ),
    "text-over-a-regex": (
        CHAT,
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "text"}},
    ),
    "choice-not-a-list": (COMPLETIONS, {"structured_outputs": {"choice": "yes"}}),
    "constraints-not-an-object": (COMPLETIONS, {"structured_outputs": []}),
    "constraints-a-string-chat": (CHAT, {"structured_outputs": "json"}),
    "beside-a-named-tool": (
        CHAT,
        {
            "structured_outputs": {"regex": "a"},
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
    ),
    "beam-search": (
        COMPLETIONS,
        {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
            "use_beam_search": True,
            "n": 2,
        },
    ),
}
STRUCTURED_BODIES = {
    name: (
        path,
        {
            "model": MODEL_NAME,
            "max_tokens": 4,
            "temperature": 0,
            **({"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT}),
            **fields,
        },
    )
    for name, (path, fields) in STRUCTURED_FIELDS.items()
}


@pytest.mark.parametrize(
    "bodies",
    [TOKENIZE_BODIES, STRUCTURED_BODIES],
    ids=["tokenize", "structured-outputs"],
)
async def test_the_fake_engine_serves_and_refuses_as_vllm_does(
    http: aiohttp.ClientSession,
    servers: Servers,
    fake: str,
    bodies: dict[str, tuple[str, Any]],
) -> None:
    await servers.use({"producer": EngineSpec("producer")})
    vllm_url = servers.engine("producer").url
    differ = {}
    for name, (path, body) in bodies.items():
        answers = []
        for url in (vllm_url, fake):
            async with http.post(url + path, json=body) as response:
                got = await response.json()
                answers.append(
                    (response.status, shape(got) if response.status == 200 else got)
                )
        if answers[0] != answers[1]:
            differ[name] = answers
    assert not differ


async def first_choice(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> dict[str, Any]:
    status, answer = await post(http, url + COMPLETIONS, body)
    assert status == 200, answer
    choice: dict[str, Any] = answer["choices"][0]
    return choice


async def check_stop_rules(http: aiohttp.ClientSession, url: str) -> None:
    """On the engine's own greedy output: a stop token id ends it where it
    first comes, its text kept only with ``include_stop_str_in_output``;
    until ``min_tokens`` the sampler masks it, and the logprobs, raw, still
    rank it first; its text as a stop string ends the text."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
    }
    free = await first_choice(http, url, body)
    ids, texts = free["token_ids"], free["logprobs"]["tokens"]
    # A token not generated before it, past the first, with text of its own.
    k = next(
        k
        for k in range(2, len(ids) + 1)
        if ids[k - 1] not in ids[: k - 1]
        and texts[k - 1].isascii()
        and texts[k - 1].strip()
    )
    stop = ids[k - 1]
    stopped = await first_choice(http, url, {**body, "stop_token_ids": [stop]})
    assert stopped["token_ids"] == ids[:k]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    kept = await first_choice(
        http,
        url,
        {**body, "stop_token_ids": [stop], "include_stop_str_in_output": True},
    )
    assert kept["token_ids"] == ids[:k]
    assert kept["text"] == stopped["text"] + texts[k - 1]
    assert free["text"].startswith(kept["text"])
    held = await first_choice(
        http, url, {**body, "stop_token_ids": [stop], "min_tokens": k}
    )
    assert held["token_ids"][: k - 1] == ids[: k - 1]
    assert stop not in held["token_ids"][:k]
    logprobs = held["logprobs"]
    top = logprobs["top_logprobs"][k - 1]
    assert top[texts[k - 1]] > logprobs["token_logprobs"][k - 1]
    # That token's text as a stop string: the text ends before its first
    # occurrence, or after it where asked.
    string = texts[k - 1]
    at = free["text"].index(string)
    for keep in (False, True):
        fields = {"stop": [string], "include_stop_str_in_output": keep}
        cut = await first_choice(http, url, {**body, **fields})
        assert cut["text"] == free["text"][: at + len(string) * keep]
        assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", string)


async def test_vllm_and_the_fake_engine_follow_the_same_stop_rules(
    http: aiohttp.ClientSession, servers: Servers, fake: str
) -> None:
    await servers.use({"producer": EngineSpec("producer")})
    await check_stop_rules(http, servers.engine("producer").url)
    await check_stop_rules(http, fake)


async def check_logits_processors(
    http: aiohttp.ClientSession, url: str, eos_token_id: int
) -> None:
    """What the logits processors do to the engine's greedy output: a bias
    of 100 on EOS makes every token EOS, which ``ignore_eos`` generates and
    goes on past; ``min_tokens`` masks EOS, ignored or not; a bias of -100
    drops the greedy pick; ``allowed_token_ids`` keep the output to them;
    a bad word is never generated."""
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    eos = [eos_token_id]
    forced = {**body, "logit_bias": {str(eos_token_id): 100}}
    ignored = await first_choice(http, url, {**forced, "ignore_eos": True})
    assert (ignored["token_ids"], ignored["finish_reason"]) == (eos * 6, "length")
    assert ignored["text"] == ""
    shown = {**forced, "ignore_eos": True, "skip_special_tokens": False}
    assert (await first_choice(http, url, shown))["text"] == "</s>" * 6
    held = await first_choice(
        http, url, {**forced, "ignore_eos": True, "min_tokens": 3}
    )
    assert held["token_ids"][3:] == eos * 3
    assert eos_token_id not in held["token_ids"][:3]
    ended = await first_choice(http, url, {**forced, "min_tokens": 3})
    assert ended["token_ids"] == held["token_ids"][:4]
    assert (ended["finish_reason"], ended["stop_reason"]) == ("stop", None)
    free = (await first_choice(http, url, {**body, "ignore_eos": True}))["token_ids"]
    # Biases are clamped to [-100, 100]: the likelier of two at 100 wins.
    other = str((free[0] + 1) % 256)
    clamped = {
        **body,
        "ignore_eos": True,
        "logit_bias": {str(free[0]): 100, other: 1000},
    }
    assert (await first_choice(http, url, clamped))["token_ids"][0] == free[0]
    low = {
        **body,
        "ignore_eos": True,
        "logit_bias": {str(free[0]): -1000, other: -100},
        "allowed_token_ids": [free[0], int(other)],
    }
    assert (await first_choice(http, url, low))["token_ids"][0] == free[0]
    dropped = {**body, "ignore_eos": True, "logit_bias": {str(free[0]): -100}}
    assert (await first_choice(http, url, dropped))["token_ids"][0] != free[0]
    allowed = {**body, "ignore_eos": True, "allowed_token_ids": [free[2]]}
    assert (await first_choice(http, url, allowed))["token_ids"] == [free[2]] * 6
    # A bad word of the first token's text: that token is never generated.
    text = (await first_choice(http, url, {**body, "max_tokens": 1}))["text"]
    bad = {**body, "ignore_eos": True, "bad_words": [text]}
    assert free[0] not in (await first_choice(http, url, bad))["token_ids"]


async def test_vllm_and_the_fake_engine_apply_logit_bias_and_allowed_token_ids_alike(
    http: aiohttp.ClientSession, servers: Servers, fake: str
) -> None:
    await servers.use({"producer": EngineSpec("producer")})
    await check_logits_processors(
        http, servers.engine("producer").url, TINY_EOS_TOKEN_ID
    )
    await check_logits_processors(http, fake, EOS_TOKEN_ID)
