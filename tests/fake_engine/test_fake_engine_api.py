"""The fake engine's HTTP surface looks like vLLM's OpenAI server: response
shapes, SSE framing, usage, stop conditions, models, health, and vLLM's
error JSON for malformed requests, after which the engine keeps serving."""

from __future__ import annotations

import logging
import re
from typing import Any

import aiohttp
import msgspec
import pytest
import torch
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    PROMPT,
    chat_body,
    completion_body,
    post,
    post_bytes,
    stream,
    streamed_text,
    text_of,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from fake_engine.testing import EngineSpec, fake_engines
from fake_engine.tokenizer import EOS_TEXT, EOS_TOKEN_ID, decode
from tests.support.requests import request_bodies


async def test_completion_has_vllms_shape(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(
        session, url + COMPLETIONS, completion_body(), {"X-Request-Id": "r1"}
    )
    assert status == 200
    assert answer["id"] == "cmpl-r1"
    assert answer["object"] == "text_completion"
    assert answer["model"] == "kvguard/fake-model"
    assert list(answer) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None and choice["logprobs"] is None
    assert len(choice["text"]) == 12
    assert answer["usage"] == {
        "prompt_tokens": len(PROMPT),
        "total_tokens": len(PROMPT) + 12,
        "completion_tokens": 12,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert answer["kv_transfer_params"] is None


async def test_same_prompt_gives_same_text_and_other_prompts_other_text(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, first = await post(session, url + COMPLETIONS, completion_body())
    _, again = await post(session, url + COMPLETIONS, completion_body())
    _, other = await post(
        session, url + COMPLETIONS, completion_body(prompt=PROMPT + "!")
    )
    assert text_of(first) == text_of(again) != text_of(other)


async def test_completion_stream_is_vllms_sse(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, whole = await post(session, url + COMPLETIONS, completion_body())
    body = completion_body(stream=True, stream_options={"include_usage": True})
    status, events = await stream(session, url + COMPLETIONS, body)
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) == 12
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        assert chunk["id"].startswith("cmpl-")
        assert set(chunk["choices"][0]) == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
            "prompt_token_ids",
            "token_ids",
        }
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 11 + [
        "length"
    ]
    assert streamed_text(chunks) == text_of(whole)
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": len(PROMPT),
        "total_tokens": len(PROMPT) + 12,
        "completion_tokens": 12,
    }


async def test_chat_completion_and_its_stream(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, whole = await post(session, url + CHAT, chat_body())
    assert status == 200
    # vLLM's random_uuid: 16 hex characters.
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", whole["id"])
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and len(message["content"]) == 12
    status, events = await stream(session, url + CHAT, chat_body(stream=True))
    assert status == 200
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert streamed_text(events) == message["content"]


async def test_continuous_usage_in_every_chunk(
    session: aiohttp.ClientSession, url: str
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = completion_body(max_tokens=3, stream=True, stream_options=options)
    _, events = await stream(session, url + COMPLETIONS, body)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 3]


async def test_stop_string_ends_the_text(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, free = await post(session, url + COMPLETIONS, completion_body(max_tokens=40))
    text = text_of(free)
    stop = text[5:7]
    first = text.index(stop)
    _, stopped = await post(
        session, url + COMPLETIONS, completion_body(max_tokens=40, stop=[stop])
    )
    choice = stopped["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == text[:first]
    body = completion_body(max_tokens=40, stop=stop, stream=True)
    _, events = await stream(session, url + COMPLETIONS, body)
    assert streamed_text(events) == text[:first]
    assert events[-2]["choices"][0]["stop_reason"] == stop
    # Kept where asked; found at the very start too.
    body = completion_body(max_tokens=40, stop=[stop], include_stop_str_in_output=True)
    _, kept = await post(session, url + COMPLETIONS, body)
    assert text_of(kept) == text[: first + len(stop)]
    body = completion_body(max_tokens=40, stop=[text[:2]])
    _, at_start = await post(session, url + COMPLETIONS, body)
    assert (text_of(at_start), at_start["choices"][0]["finish_reason"]) == ("", "stop")


async def test_a_stream_holds_back_only_what_could_still_become_a_stop_string(
    session: aiohttp.ClientSession, url: str
) -> None:
    # As vLLM's detokenizer: each event's text lags the output by the longest
    # stop string less one character ("#" is no generated character).
    body = completion_body(max_tokens=8, stream=True)
    _, free = await post(session, url + COMPLETIONS, {**body, "stream": False})
    text = text_of(free)
    for stop, lag in ((["#"], 0), (["#", "###"], 2)):
        _, events = await stream(session, url + COMPLETIONS, {**body, "stop": stop})
        texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict)]
        # One event per token; the last one has the rest.
        assert len(texts) == len(text)
        sent = [len("".join(texts[: i + 1])) for i in range(len(texts) - 1)]
        assert sent == [max(0, n - lag) for n in range(1, len(text))]
        assert "".join(texts) == text


async def test_stop_token_id_ends_the_output_with_it(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = completion_body(max_tokens=20, return_token_ids=True)
    _, free = await post(session, url + COMPLETIONS, body)
    ids = free["choices"][0]["token_ids"]
    stop = ids[6]
    first = ids.index(stop)
    _, stopped = await post(
        session, url + COMPLETIONS, {**body, "stop_token_ids": [stop]}
    )
    choice = stopped["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    # The stop token is the last of the output, as vLLM counts it.
    assert choice["token_ids"] == ids[: first + 1]
    assert stopped["usage"]["completion_tokens"] == first + 1
    # Its text only where asked, as vLLM's detokenizer.
    assert text_of(stopped) == decode(ids[:first])
    _, kept = await post(
        session,
        url + COMPLETIONS,
        {**body, "stop_token_ids": [stop], "include_stop_str_in_output": True},
    )
    assert text_of(kept) == decode(ids[: first + 1])


async def test_stop_tokens_and_strings_end_the_output_only_past_min_tokens(
    session: aiohttp.ClientSession, url: str
) -> None:
    # As vLLM: the stop conditions of the k-th output token are checked only
    # once k > min_tokens (a stop string's text at k is then passed over),
    # and until then the sampler masks stop tokens (their logprobs are
    # taken before the mask).
    body = completion_body(max_tokens=40, return_token_ids=True, logprobs=1)
    _, free = await post(session, url + COMPLETIONS, body)
    ids = free["choices"][0]["token_ids"]
    text = text_of(free)
    # Byte tokens: the k-th token's text is the k-th character.
    assert len(text) == len(ids)
    # The k-th token's is its only occurrence.
    k = next(k for k in range(4, len(ids)) if ids.count(ids[k - 1]) == 1)
    for stop in ({"stop_token_ids": [ids[k - 1]]}, {"stop": [text[k - 1]]}):
        _, ended = await post(
            session, url + COMPLETIONS, {**body, **stop, "min_tokens": k - 1}
        )
        _, held = await post(
            session, url + COMPLETIONS, {**body, **stop, "min_tokens": k}
        )
        assert ended["choices"][0]["finish_reason"] == "stop"
        assert ended["usage"]["completion_tokens"] == k
        assert held["usage"]["completion_tokens"] > k
        if "stop" in stop:
            # A stop string passed over is not found later.
            finish = held["choices"][0]["finish_reason"]
            assert (text_of(held), finish) == (text, "length")
        else:
            # The masked stop token gives way to another, still ranked first.
            held_ids = held["choices"][0]["token_ids"]
            assert held_ids[: k - 1] == ids[: k - 1]
            assert held_ids[k - 1] != ids[k - 1]
            logprobs = held["choices"][0]["logprobs"]
            top = logprobs["top_logprobs"][k - 1]
            assert top[text[k - 1]] > logprobs["token_logprobs"][k - 1]
            # Asked by id, the masked token comes after the generated one.
            asked = {**body, **stop, "min_tokens": k, "logprob_token_ids": [ids[k - 1]]}
            _, requested = await post(session, url + COMPLETIONS, asked)
            logprobs = requested["choices"][0]["logprobs"]
            generated = logprobs["tokens"][k - 1]
            assert list(logprobs["top_logprobs"][k - 1]) == [generated, text[k - 1]]


async def test_eos_ends_the_output_unless_ignored_or_before_min_tokens(
    session: aiohttp.ClientSession, url: str
) -> None:
    # The first of these prompts whose greedy output the fake model ends
    # with EOS (one token in 128 may be EOS).
    for i in range(20):
        body = completion_body(
            prompt=f"until EOS {i}",
            max_tokens=200,
            ignore_eos=False,
            return_token_ids=True,
        )
        _, answer = await post(session, url + COMPLETIONS, body)
        choice = answer["choices"][0]
        if choice["finish_reason"] == "stop":
            break
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    ids = choice["token_ids"]
    ended = len(ids)
    assert ids[-1] == EOS_TOKEN_ID
    # EOS's text only where asked, and not skipped as a special token.
    special = {"skip_special_tokens": False}
    _, bare = await post(session, url + COMPLETIONS, {**body, **special})
    _, kept = await post(
        session,
        url + COMPLETIONS,
        {**body, **special, "include_stop_str_in_output": True},
    )
    assert text_of(bare) == text_of(answer) == decode(ids)
    assert text_of(kept) == text_of(answer) + EOS_TEXT
    # As vLLM: an ignored EOS is generated and its text skipped.
    _, ignored = await post(session, url + COMPLETIONS, {**body, "ignore_eos": True})
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["choices"][0]["token_ids"][:ended] == ids
    assert len(ignored["choices"][0]["token_ids"]) == 200
    assert text_of(ignored).startswith(text_of(answer))
    # Until min_tokens the sampler masks EOS, ignored or not.
    for ignore_eos in (False, True):
        _, held = await post(
            session,
            url + COMPLETIONS,
            {**body, "min_tokens": ended + 5, "ignore_eos": ignore_eos},
        )
        held_ids = held["choices"][0]["token_ids"]
        assert held_ids[: ended - 1] == ids[:-1]
        assert EOS_TOKEN_ID not in held_ids[: ended + 5]


async def test_logit_bias_and_allowed_token_ids_steer_the_output_as_on_vllm(
    session: aiohttp.ClientSession, url: str
) -> None:
    # As vLLM's logits processors (tests/vllm/test_fake_engine_wire.py runs
    # the same on both engines).
    body = completion_body(max_tokens=6, return_token_ids=True)
    _, free = await post(session, url + COMPLETIONS, body)
    ids = free["choices"][0]["token_ids"]
    eos = {"logit_bias": {str(EOS_TOKEN_ID): 100}}
    _, forced = await post(session, url + COMPLETIONS, {**body, **eos})
    assert forced["choices"][0]["token_ids"] == [EOS_TOKEN_ID] * 6
    _, held = await post(session, url + COMPLETIONS, {**body, **eos, "min_tokens": 2})
    assert held["choices"][0]["token_ids"][:2] == ids[:2]
    assert held["choices"][0]["token_ids"][2:] == [EOS_TOKEN_ID] * 4
    # Biases are clamped to [-100, 100]: the likelier of two at 100 wins.
    clamped = {"logit_bias": {str(ids[0]): 100, str(ord("Q")): 1000}}
    _, both = await post(session, url + COMPLETIONS, {**body, **clamped})
    assert both["choices"][0]["token_ids"][0] == ids[0]
    low = {
        "logit_bias": {str(ids[0]): -1000, str(ord("Q")): -100},
        "allowed_token_ids": [ids[0], ord("Q")],
    }
    _, both = await post(session, url + COMPLETIONS, {**body, **low})
    assert both["choices"][0]["token_ids"][0] == ids[0]
    dropped = {"logit_bias": {str(ids[0]): -100}}
    _, other = await post(session, url + COMPLETIONS, {**body, **dropped})
    assert other["choices"][0]["token_ids"][0] != ids[0]
    allowed = {"allowed_token_ids": [ord("Q"), ids[0]]}
    _, kept = await post(session, url + COMPLETIONS, {**body, **allowed})
    assert set(kept["choices"][0]["token_ids"]) <= {ord("Q"), ids[0]}
    # The greedy pick, allowed, stays.
    assert kept["choices"][0]["token_ids"][0] == ids[0]


async def test_bad_words_are_never_completed(
    session: aiohttp.ClientSession, url: str
) -> None:
    # As vLLM's bad-words processor: a word's last token is masked where its
    # other tokens end the output (a one-token word: everywhere).
    body = completion_body(max_tokens=20, return_token_ids=True)
    _, free = await post(session, url + COMPLETIONS, body)
    ids = free["choices"][0]["token_ids"]
    assert len(set(ids[:3])) == 3
    _, two = await post(
        session, url + COMPLETIONS, {**body, "bad_words": [" " + decode(ids[1:3])]}
    )
    out = two["choices"][0]["token_ids"]
    assert out[:2] == ids[:2] and out[2] != ids[2]
    assert all(out[i : i + 2] != ids[1:3] for i in range(len(out)))
    _, one = await post(
        session, url + COMPLETIONS, {**body, "bad_words": [decode(ids[:1])]}
    )
    assert ids[0] not in one["choices"][0]["token_ids"]
    # Masked besides what min_tokens masks.
    eos = {"logit_bias": {str(EOS_TOKEN_ID): 100}, "min_tokens": 2, "bad_words": ["Q"]}
    _, held = await post(session, url + COMPLETIONS, {**body, **eos})
    assert held["choices"][0]["token_ids"][:3] == [*ids[:2], EOS_TOKEN_ID]


async def test_echo_puts_the_prompt_before_the_text_or_its_ids_where_asked(
    session: aiohttp.ClientSession, url: str
) -> None:
    # As vLLM 0.32: with return_token_ids the prompt's ids replace its text.
    body = completion_body(prompt=[72, 105], max_tokens=3)
    _, plain = await post(session, url + COMPLETIONS, body)
    _, echo = await post(session, url + COMPLETIONS, {**body, "echo": True})
    assert echo["choices"][0]["text"] == "Hi" + text_of(plain)
    assert echo["choices"][0]["prompt_token_ids"] is None
    body.update(echo=True, return_token_ids=True)
    _, answer = await post(session, url + COMPLETIONS, body)
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == [72, 105]
    assert len(choice["token_ids"]) == 3
    assert choice["text"] == text_of(plain)


async def test_an_echo_stream_carries_the_prompts_ids_in_its_first_chunk(
    session: aiohttp.ClientSession, url: str
) -> None:
    # vLLM's completions stream does, return_token_ids or not.
    body = completion_body(prompt=[72, 105], max_tokens=3, echo=True, stream=True)
    _, events = await stream(session, url + COMPLETIONS, body)
    ids = [e["choices"][0]["prompt_token_ids"] for e in events[:-1]]
    assert ids == [[72, 105], None, None]
    assert streamed_text(events).startswith("Hi")


async def test_an_echo_without_generation_answers_with_the_prompt_alone(
    session: aiohttp.ClientSession, url: str
) -> None:
    # As vLLM 0.32's CompletionRequest: max_tokens 0 with echo samples one
    # token, which counts in usage and token_ids but not in the text or the
    # logprobs, those of the prompt.
    body = completion_body(prompt=[72, 105], max_tokens=0, echo=True)
    _, answer = await post(session, url + COMPLETIONS, {**body, "logprobs": 1})
    (choice,) = answer["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hi", "length")
    assert choice["logprobs"]["tokens"] == ["H", "i"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert answer["usage"]["completion_tokens"] == 1
    _, ids = await post(session, url + COMPLETIONS, {**body, "return_token_ids": True})
    (choice,) = ids["choices"]
    assert (choice["text"], choice["prompt_token_ids"]) == ("", [72, 105])
    assert len(choice["token_ids"]) == 1
    _, events = await stream(session, url + COMPLETIONS, {**body, "stream": True})
    (chunk,) = [e["choices"][0] for e in events[:-1]]
    assert (chunk["text"], chunk["finish_reason"]) == ("Hi", "length")
    assert chunk["prompt_token_ids"] == [72, 105]


async def test_unknown_fields_are_accepted_with_a_warning(
    session: aiohttp.ClientSession, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvguard.fake_engine.protocol")
    body = completion_body(router_hint="prefill-3")
    status, _ = await post(session, url + COMPLETIONS, body)
    assert status == 200
    assert "router_hint" in caplog.text


async def test_models_and_health(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(url + "/v1/models") as response:
        models = await response.json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "kvguard/fake-model"
    assert models["data"][0]["max_model_len"] == 256
    async with session.get(url + "/health") as response:
        assert response.status == 200
    # vLLM's version and SageMaker's health check.
    async with session.get(url + "/version") as response:
        assert await response.json() == {"version": "0.32.0"}
    for method in ("GET", "POST"):
        async with session.request(method, url + "/ping") as response:
            assert response.status == 200


def assert_vllm_error(
    answer: dict, status: int, err_type: str, param: str | None
) -> None:
    assert set(answer) == {"error"}
    error = answer["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert (error["type"], error["code"], error["param"]) == (err_type, status, param)
    assert error["message"]


# The error type of a body FastAPI cannot validate (vLLM's
# validation_exception_handler), and of an error vLLM raises itself.
SCHEMA = "Bad Request"
VLLM = "BadRequestError"

BAD_REQUESTS = [
    pytest.param(COMPLETIONS, {}, "prompt", VLLM, id="completion-without-prompt"),
    pytest.param(
        CHAT, {"max_tokens": 3}, "body.messages", SCHEMA, id="chat-without-messages"
    ),
    pytest.param(
        COMPLETIONS,
        {"prompt": "x", "max_tokens": "many"},
        "body.max_tokens",
        SCHEMA,
        id="max-tokens-not-int",
    ),
    pytest.param(
        CHAT, {"messages": "hello"}, "body.messages", SCHEMA, id="messages-not-list"
    ),
    pytest.param(
        CHAT,
        {"messages": [{"content": "hi"}]},
        "body.messages.0.role",
        SCHEMA,
        id="no-role",
    ),
    pytest.param(
        COMPLETIONS, {"prompt": 7}, "body.prompt", SCHEMA, id="prompt-not-text"
    ),
    pytest.param(
        COMPLETIONS, {"prompt": [1, 300]}, "prompt", VLLM, id="token-out-of-vocab"
    ),
    # vLLM: "The decoder prompt cannot be empty" (400), not a failed engine step.
    pytest.param(
        COMPLETIONS, {"prompt": [""]}, None, VLLM, id="prompt-list-of-empty-text"
    ),
    pytest.param(
        COMPLETIONS, {"prompt": "x" * 300}, "input_tokens", VLLM, id="prompt-too-long"
    ),
    pytest.param(
        COMPLETIONS,
        {"prompt": "x", "max_tokens": -1},
        "max_tokens",
        VLLM,
        id="negative-max-tokens",
    ),
    pytest.param(
        COMPLETIONS,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
        VLLM,
        id="stream-options-without-stream",
    ),
    pytest.param(COMPLETIONS, [1, 2], "body", SCHEMA, id="body-not-object"),
    pytest.param(
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        None,
        VLLM,
        id="image-content",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "err_type"), BAD_REQUESTS)
async def test_malformed_request_gets_a_400_and_the_engine_keeps_serving(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: object,
    param: str | None,
    err_type: str,
) -> None:
    status, answer = await post(session, url + path, body)
    assert status == 400
    assert_vllm_error(answer, 400, err_type, param)
    status, _ = await post(session, url + COMPLETIONS, completion_body(max_tokens=2))
    assert status == 200


# Sampling values vLLM 0.32's SamplingParams refuses, with its messages.
OUT_OF_RANGE = {
    "presence-penalty": (
        {"presence_penalty": 3},
        "presence_penalty must be in [-2, 2], got 3.0.",
    ),
    "frequency-penalty": (
        {"frequency_penalty": -2.5},
        "frequency_penalty must be in [-2, 2], got -2.5.",
    ),
    "repetition-penalty": (
        {"repetition_penalty": 0},
        "repetition_penalty must be greater than zero, got 0.0.",
    ),
    "temperature-negative": (
        {"temperature": -1},
        "temperature must be non-negative, got -1.0. "
        "(parameter=temperature, value=-1.0)",
    ),
    "temperature-above-2": (
        {"temperature": 2.5},
        "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
    ),
    "top-p-0": (
        {"top_p": 0},
        "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
    ),
    "top-k": ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
    "min-p": ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("fields", "message"), OUT_OF_RANGE.values(), ids=OUT_OF_RANGE.keys()
)
async def test_sampling_values_vllm_refuses_are_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    fields: dict[str, float],
    message: str,
) -> None:
    # The model is greedy, but a proxy in front must see vLLM's 400.
    body = completion_body(max_tokens=2) if path == COMPLETIONS else chat_body()
    status, answer = await post(session, url + path, {**body, **fields})
    assert status == 400
    assert answer["error"]["message"] == message
    edge = {name: 1 if name != "top_k" else -1 for name in fields}
    status, _ = await post(session, url + path, {**body, **edge})
    assert status == 200


async def test_bad_json_gets_vllms_validation_error(
    session: aiohttp.ClientSession, url: str
) -> None:
    headers = {"Content-Type": "application/json"}
    status, answer = await post_bytes(
        session, url + COMPLETIONS, b'{"prompt": ', headers
    )
    assert status == 400
    assert_vllm_error(answer, 400, SCHEMA, answer["error"]["param"])
    assert "JSON decode error" in answer["error"]["message"]
    status, answer = await post_bytes(session, url + COMPLETIONS, b"prompt=x")
    assert status == 400
    assert "Only 'application/json' is allowed" in answer["error"]["message"]


async def test_unknown_model_gets_a_404(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(session, url + CHAT, chat_body(model="gpt-9"))
    assert status == 404
    assert_vllm_error(answer, 404, "NotFoundError", "model")
    assert "`gpt-9` does not exist" in answer["error"]["message"]


async def test_unknown_route_answers_as_fastapi(
    session: aiohttp.ClientSession, url: str
) -> None:
    async with session.get(url + "/v1/nothing") as response:
        assert response.status == 404
        assert await response.json() == {"detail": "Not Found"}


async def test_abort_route_refuses_malformed_bodies(
    session: aiohttp.ClientSession, url: str
) -> None:
    path = url + "/inference/v1/abort_requests"
    status, answer = await post(session, path, {"ids": []})
    assert status == 400
    assert answer["error"]["message"] == "Missing 'request_ids' in request body"
    status, answer = await post(session, path, {"request_ids": [1]})
    assert status == 400
    status, answer = await post(session, path, {"request_ids": ["nobody"]})
    assert (status, answer) == (200, None)


async def test_fault_admin_is_off_unless_enabled(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, _ = await post(session, url + "/kvguard/faults", {"fault": "bitflip"})
    assert status == 404


async def test_fault_admin_validates_and_reports(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(EngineSpec(enable_fault_admin=True)) as urls:
        path = urls[0] + "/kvguard/faults"
        status, answer = await post(session, path, {"fault": "meltdown"})
        assert status == 400 and answer["error"]["param"] == "body.fault"
        status, answer = await post(session, path, {"fault": "zero", "rate": 2})
        assert status == 400
        status, answer = await post(
            session,
            path,
            {"fault": "zero", "side": "consumer", "rate": 0.5, "count": 3},
        )
        assert status == 200
        async with session.get(path) as response:
            state = await response.json()
        assert state == {
            "fault": "zero",
            "side": "consumer",
            "rate": 0.5,
            "count": 3,
            "delay_s": 1.0,
            "remaining": 3,
            "injected": {},
        }


async def test_in_process_engines_compute_on_one_torch_thread_until_they_stop() -> None:
    # Each engine computes in its own thread on tiny tensors: more intra-op
    # threads per engine only oversubscribe the cores.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async with fake_engines(EngineSpec(), EngineSpec()) as urls:
            for index in range(2):
                executor = urls.engine(index)._executor
                assert executor.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


_STREAM = TypeAdapter(bool | None)


@settings(
    max_examples=100,
    deadline=None,
    # One engine serves every example: it must keep serving.
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=request_bodies(), chat=st.booleans())
@example(body={"prompt": "hi", "stream": 1}, chat=False)
async def test_any_json_body_gets_a_reply_or_vllms_error_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], chat: bool
) -> None:
    path = CHAT if chat else COMPLETIONS
    async with session.post(url + path, json=body) as response:
        status, data = response.status, await response.read()
        content_type = response.content_type
    assert status in (200, 400, 404), data
    if status != 200:
        error = msgspec.json.decode(data)["error"]
        assert error["code"] == status
        assert isinstance(error["message"], str)
        return
    # vLLM's field is a pydantic bool: 1, 1.0 and "yes" stream too.
    streams = _STREAM.validate_python(body.get("stream"))
    assert (content_type == "text/event-stream") == bool(streams)
    if streams:
        assert data.endswith(b"data: [DONE]\n\n")
    else:
        assert msgspec.json.decode(data)["choices"]
