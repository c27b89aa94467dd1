"""Beam search as vLLM's server runs it: one request per beam and token,
each asking for twice the width in logprobs, the ``n`` best beams (by
logprob over length) the choices."""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp
import pytest
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    chat_body,
    completion_body,
    post,
    stream,
    text_of,
)

from fake_engine.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, encode

BEAMS = {"use_beam_search": True, "n": 3}


async def test_the_best_beams_are_the_choices_best_first(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(
        session, url + COMPLETIONS, completion_body(logprobs=1, **BEAMS)
    )
    assert status == 200
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3
    # Every beam ran to max_tokens (the body ignores EOS): the sums of their
    # tokens' logprobs rank them.
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert scores == sorted(scores, reverse=True)
    for choice in choices:
        assert choice["finish_reason"] == "length"
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert answer["usage"]["completion_tokens"] == 3 * 12
    # The model's own picks are a beam, and the likeliest one here.
    _, greedy = await post(session, url + COMPLETIONS, completion_body())
    assert choices[0]["text"] == text_of(greedy)


async def test_beams_are_ranked_by_vllms_score_its_length_penalty_included(
    session: aiohttp.ClientSession, url: str
) -> None:
    # vLLM's get_beam_search_score: the beam's logprob over its length (the
    # prompt's tokens included, a final EOS not) to the length_penalty.
    body = completion_body(
        max_tokens=150,
        ignore_eos=False,
        logprobs=1,
        include_stop_str_in_output=True,
        return_token_ids=True,
        **BEAMS,
    )
    reasons = {}
    for penalty in (1.0, 2.0):
        _, answer = await post(
            session, url + COMPLETIONS, {**body, "length_penalty": penalty}
        )
        num_prompt = answer["usage"]["prompt_tokens"]
        scores = []
        for choice in answer["choices"]:
            ids = choice["token_ids"]
            length = num_prompt + len(ids) - (ids[-1] == EOS_TOKEN_ID)
            logprob = sum(choice["logprobs"]["token_logprobs"])
            scores.append(logprob / length**penalty)
        assert scores == sorted(scores, reverse=True)
        reasons[penalty] = [c["finish_reason"] for c in answer["choices"]]
    # This prompt's one beam that ends in EOS is a third as long as the
    # others: the best under penalty 1, out under 2.
    assert reasons == {1.0: ["stop", "length", "length"], 2.0: ["length"] * 3}


async def test_a_chat_beam_search_streams_each_beam_whole(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, whole = await post(session, url + CHAT, chat_body(**BEAMS))
    status, events = await stream(session, url + CHAT, chat_body(stream=True, **BEAMS))
    assert status == 200 and events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (
            choice["delta"].get("content") or ""
        )
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}


async def test_beams_ending_in_eos_stop_there(
    session: aiohttp.ClientSession, url: str
) -> None:
    # Long beams without ignore_eos: EOS is among each step's candidates only
    # where the model would pick it, so beams end there or run to the end.
    body = completion_body(max_tokens=150, ignore_eos=False, **BEAMS)
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 200
    for choice in answer["choices"]:
        if choice["finish_reason"] == "stop":
            assert choice["stop_reason"] == 256  # vLLM names the EOS token
        else:
            assert len(encode(choice["text"])) == 150


@pytest.mark.parametrize(
    ("route", "fields", "message"),
    [
        (
            COMPLETIONS,
            {"stream": True},
            "Streaming is not currently supported with beam search",
        ),
        (
            COMPLETIONS,
            {"echo": True, "logprobs": 1},
            "`echo` with `logprobs` is not supported with beam search",
        ),
        (
            CHAT,
            {"n": 11},
            "Requested sample logprobs of 22, which is greater than max allowed: 20",
        ),
    ],
)
async def test_beam_searches_vllm_refuses_are_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    route: str,
    fields: dict[str, Any],
    message: str,
) -> None:
    make = completion_body if route == COMPLETIONS else chat_body
    status, answer = await post(session, url + route, make(**{**BEAMS, **fields}))
    assert status == 400
    assert answer["error"]["message"].startswith(message)


async def test_a_beam_search_takes_and_ignores_what_steers_sampling(
    session: aiohttp.ClientSession, url: str
) -> None:
    # vLLM's beam search builds no SamplingParams from the body: logit_bias,
    # allowed_token_ids, stop_token_ids and bad_words are neither checked nor
    # applied.
    _, plain = await post(session, url + COMPLETIONS, completion_body(**BEAMS))
    steered = completion_body(
        **BEAMS,
        logit_bias={"x": 1, "65": 100},
        allowed_token_ids=[],
        stop_token_ids=[VOCAB_SIZE],
        bad_words=["", "  "],
    )
    status, answer = await post(session, url + COMPLETIONS, steered)
    assert status == 200
    assert [c["text"] for c in answer["choices"]] == [
        c["text"] for c in plain["choices"]
    ]


async def test_a_beams_eos_is_in_its_tokens_only_where_asked_never_in_its_text(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = completion_body(
        max_tokens=150, ignore_eos=False, return_token_ids=True, **BEAMS
    )
    texts = {}
    # As vLLM's beam search, which decodes a beam without its final EOS:
    # not even a request that keeps special tokens sees it.
    for keep, skip in itertools.product((False, True), (True, False)):
        fields = {"include_stop_str_in_output": keep, "skip_special_tokens": skip}
        _, answer = await post(session, url + COMPLETIONS, {**body, **fields})
        (stopped, *_) = [c for c in answer["choices"] if c["finish_reason"] == "stop"]
        assert (stopped["token_ids"][-1] == 256) is keep
        texts[keep, skip] = stopped["text"]
    assert len(set(texts.values())) == 1 and texts[False, True]
