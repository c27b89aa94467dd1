"""Logprobs as vLLM returns them: of each generated token (the model's pick,
rank 1) with the next likeliest, of an echoed prompt's tokens, and
``prompt_logprobs``; streamed or whole alike, and the same through a P/D
pair as from one engine."""

from __future__ import annotations

import itertools
import math
from typing import Any

import aiohttp
import pytest
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    PROMPT,
    chat_body,
    completion_body,
    pd,
    post,
    stream,
    text_of,
)

from fake_engine.config import EngineConfig, Role
from fake_engine.model import FakeModel
from fake_engine.testing import EngineSpec, fake_engines
from fake_engine.tokenizer import encode


def test_the_models_pick_is_its_likeliest_token_in_a_distribution() -> None:
    model = FakeModel(EngineConfig())
    for digest in range(50):
        likeliest = model.logprobs(digest, 9, allow_eos=True, count=20)
        assert likeliest[0].token_id == model.next_token(digest, 9, allow_eos=True)
        assert [e.rank for e in likeliest] == list(range(1, 21))
        assert len({e.token_id for e in likeliest}) == 20
        assert all(a.logprob > b.logprob for a, b in itertools.pairwise(likeliest))
        assert sum(math.exp(e.logprob) for e in likeliest) < 1


def test_prompt_logprobs_rank_each_prompt_token_then_the_likeliest() -> None:
    model = FakeModel(EngineConfig())
    ids = encode(PROMPT)
    scored = model.prompt_logprobs(ids, 2)
    assert scored[0] is None and len(scored) == len(ids)
    for token_id, entries in zip(ids[1:], scored[1:], strict=True):
        assert entries is not None and entries[0].token_id == token_id
        assert [e.rank for e in entries[1:]] == [
            r for r in (1, 2) if r != entries[0].rank
        ]


async def test_completion_logprobs_name_each_token_and_its_likeliest_rivals(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(session, url + COMPLETIONS, completion_body(logprobs=3))
    assert status == 200
    logprobs = answer["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == text_of(answer)
    assert logprobs["text_offset"] == list(range(12))  # one character each
    for token, logprob, top in zip(
        logprobs["tokens"],
        logprobs["token_logprobs"],
        logprobs["top_logprobs"],
        strict=True,
    ):
        assert next(iter(top)) == token and top[token] == logprob
        assert len(top) == 3 and sorted(top.values(), reverse=True) == list(
            top.values()
        )


async def test_a_stream_carries_the_same_logprobs_chunk_by_chunk(
    session: aiohttp.ClientSession, url: str
) -> None:
    for route, body in (
        (COMPLETIONS, completion_body(logprobs=2, echo=True)),
        (CHAT, chat_body(logprobs=True, top_logprobs=2)),
    ):
        _, whole = await post(session, url + route, body)
        _, events = await stream(session, url + route, {**body, "stream": True})
        pieces = [
            e["choices"][0]["logprobs"]
            for e in events[:-1]
            if e["choices"] and e["choices"][0]["logprobs"]
        ]
        want = whole["choices"][0]["logprobs"]
        joined = {k: [x for p in pieces for x in p[k]] for k in want}
        assert joined == want, route


async def test_an_echo_scores_the_prompt_before_the_text(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(
        session, url + COMPLETIONS, completion_body(logprobs=1, echo=True)
    )
    assert status == 200
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] == PROMPT + choice["text"][70:]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(PROMPT)
    # The prompt's scores are the same in both fields.
    for position, scores in enumerate(prompt[1:], start=1):
        token = str(encode(PROMPT)[position])
        assert scores[token]["logprob"] == logprobs["token_logprobs"][position]
        assert scores[token]["decoded_token"] == PROMPT[position]


async def test_chat_lists_top_logprobs_and_prompt_logprobs_where_asked(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, answer = await post(
        session, url + CHAT, chat_body(logprobs=True, top_logprobs=2, prompt_logprobs=1)
    )
    content = answer["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == text_of(answer)
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    assert answer["prompt_logprobs"][0] is None
    assert all(len(scores) in (1, 2) for scores in answer["prompt_logprobs"][1:])
    _, plain = await post(session, url + CHAT, chat_body())
    assert plain["choices"][0]["logprobs"] is None and plain["prompt_logprobs"] is None


async def test_a_pd_pair_gives_the_logprobs_one_engine_gives(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(
        EngineSpec(role=Role.PRODUCER), EngineSpec(role=Role.CONSUMER), EngineSpec()
    ) as (prefill, decode, alone):
        body = completion_body(logprobs=2)
        _, want = await post(session, alone + COMPLETIONS, body)
        status, got = await pd(session, prefill, decode, COMPLETIONS, body)
    assert status == 200
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]


@pytest.mark.parametrize(
    ("route", "fields", "message"),
    [
        (
            COMPLETIONS,
            {"logprobs": 21},
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            CHAT,
            {"prompt_logprobs": -1},
            "Requested prompt logprobs of 257, which is greater than max allowed: 20",
        ),
        (COMPLETIONS, {"logprobs": -2}, "`logprobs` must be a positive value or -1."),
        (COMPLETIONS, {"logprobs": "2"}, "`logprobs` must be an integer."),
        (
            COMPLETIONS,
            {"prompt_logprobs": "2"},
            "`prompt_logprobs` must be an integer.",
        ),
        (CHAT, {"top_logprobs": "2"}, "`top_logprobs` must be an integer."),
        (
            CHAT,
            {"top_logprobs": 2},
            "when using `top_logprobs`, `logprobs` must be set to true.",
        ),
        (
            COMPLETIONS,
            {"stream": True, "prompt_logprobs": 1},
            "`prompt_logprobs` are not available when `stream=True`.",
        ),
    ],
)
async def test_logprobs_vllm_refuses_are_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    route: str,
    fields: dict[str, Any],
    message: str,
) -> None:
    body = (completion_body if route == COMPLETIONS else chat_body)(**fields)
    status, answer = await post(session, url + route, body)
    assert status == 400
    assert answer["error"]["message"].startswith(message)


async def test_tokens_as_token_ids_name_each_logprobs_token_by_its_id(
    session: aiohttp.ClientSession, url: str
) -> None:
    fields = {"return_tokens_as_token_ids": True}
    _, answer = await post(
        session, url + COMPLETIONS, completion_body(logprobs=1, **fields)
    )
    logprobs = answer["choices"][0]["logprobs"]
    ids = encode(text_of(answer))
    assert logprobs["tokens"] == [f"token_id:{i}" for i in ids]
    assert logprobs["text_offset"][1] == len(f"token_id:{ids[0]}")
    _, answer = await post(
        session, url + CHAT, chat_body(logprobs=True, top_logprobs=1, **fields)
    )
    (first, *_) = answer["choices"][0]["logprobs"]["content"]
    assert first["token"].startswith("token_id:")
    assert first["bytes"] == list(first["token"].encode())


async def test_logprobs_of_chosen_token_ids_are_refused_as_unsupported(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(
        session,
        url + COMPLETIONS,
        completion_body(logprobs=1, logprob_token_ids=[101]),
    )
    assert status == 400 and answer["error"]["param"] == "logprob_token_ids"
