"""Several choices (``n``) and several prompts in one request, as vLLM runs
them: each choice is a request of its own, answered with its index (its
prompt's times n, plus its own), and usage counts each prompt once and every
choice's tokens. The first choice is the model's plain continuation, the
others differ from it as sampled ones would."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import aiohttp
import pytest
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    PROMPT,
    chat_body,
    completion_body,
    metric,
    post,
    stream,
    text_of,
)

from fake_engine.testing import EngineSpec, fake_engines

OTHER = "A second prompt, about something else entirely"
SAMPLED = {"temperature": 0.8}


def texts_by_index(events: list[Any]) -> dict[int, str]:
    """Each choice's text in a stream, by its index."""
    texts: dict[int, str] = defaultdict(str)
    for event in events:
        if isinstance(event, dict):
            for choice in event["choices"]:
                texts[choice["index"]] += (
                    choice["text"]
                    if "text" in choice
                    else choice["delta"].get("content", "")
                )
    return dict(texts)


async def test_n_choices_each_continue_the_prompt_and_usage_counts_it_once(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, single = await post(session, url + COMPLETIONS, completion_body())
    status, answer = await post(
        session, url + COMPLETIONS, completion_body(n=3, **SAMPLED)
    )
    assert status == 200
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in answer["choices"]]
    assert texts[0] == text_of(single) and len(set(texts)) == 3
    _, again = await post(session, url + COMPLETIONS, completion_body(n=3, **SAMPLED))
    assert [c["text"] for c in again["choices"]] == texts
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)
    assert answer["usage"]["completion_tokens"] == 3 * 12
    assert answer["usage"]["total_tokens"] == len(PROMPT) + 36


async def test_each_of_several_prompts_is_answered_as_alone_in_prompt_order(
    session: aiohttp.ClientSession, url: str
) -> None:
    alone = []
    for prompt in (PROMPT, OTHER):
        _, answer = await post(
            session, url + COMPLETIONS, completion_body(prompt=prompt)
        )
        alone.append(text_of(answer))
    status, answer = await post(
        session,
        url + COMPLETIONS,
        completion_body(prompt=[PROMPT, OTHER], n=2, **SAMPLED),
    )
    assert status == 200
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    texts = [c["text"] for c in choices]
    assert [texts[0], texts[2]] == alone and len(set(texts)) == 4
    assert answer["usage"]["prompt_tokens"] == len(PROMPT) + len(OTHER)
    assert answer["usage"]["completion_tokens"] == 4 * 12


async def test_a_stream_of_prompts_and_choices_interleaves_them_by_index(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, whole = await post(
        session,
        url + COMPLETIONS,
        completion_body(prompt=[PROMPT, OTHER], n=2, **SAMPLED),
    )
    status, events = await stream(
        session,
        url + COMPLETIONS,
        completion_body(
            prompt=[PROMPT, OTHER],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        ),
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert texts_by_index(events) == {c["index"]: c["text"] for c in whole["choices"]}
    finishes = [
        c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]
    ]
    assert sorted(finishes) == [0, 1, 2, 3]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": len(PROMPT) + len(OTHER),
        "total_tokens": len(PROMPT) + len(OTHER) + 48,
        "completion_tokens": 48,
    }


async def test_a_chat_stream_of_choices_names_each_ones_role_first(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, single = await post(session, url + CHAT, chat_body())
    status, events = await stream(
        session, url + CHAT, chat_body(n=2, stream=True, **SAMPLED)
    )
    assert status == 200
    roles = [e["choices"][0] for e in events[:2]]
    assert [(r["index"], r["delta"]) for r in roles] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
    ]
    texts = texts_by_index(events)
    assert texts[0] == text_of(single) and texts[1] not in ("", texts[0])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
        ({"n": 0}, "n must be at least 1, got 0."),
    ],
)
async def test_choices_vllm_refuses_are_refused_in_its_words(
    session: aiohttp.ClientSession, url: str, fields: dict[str, Any], message: str
) -> None:
    status, answer = await post(session, url + COMPLETIONS, completion_body(**fields))
    assert status == 400
    assert answer["error"]["message"] == message


async def test_aborting_the_callers_id_aborts_every_choice(
    session: aiohttp.ClientSession,
) -> None:
    slow = EngineSpec(decode_tokens_per_s=20)
    async with fake_engines(slow) as (url,):
        body = completion_body(prompt=[PROMPT, OTHER], n=2, max_tokens=200, **SAMPLED)
        answering = asyncio.create_task(
            post(session, url + COMPLETIONS, body, {"X-Request-Id": "job-7"})
        )
        for _ in range(100):
            await asyncio.sleep(0.02)
            if await metric(session, url, "vllm:num_requests_running") == 4:
                break
        status, _ = await post(
            session, url + "/inference/v1/abort_requests", {"request_ids": ["job-7"]}
        )
        assert status == 200
        status, answer = await answering
        aborted = await metric(session, url, "kvguard_requests_aborted_total")
    assert status == 200
    assert [c["finish_reason"] for c in answer["choices"]] == ["abort"] * 4
    assert aborted == 4
