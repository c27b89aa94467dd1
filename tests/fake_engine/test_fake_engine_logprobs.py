"""Logprobs as vLLM returns them: of each generated token (the model's pick,
rank 1, unless ``min_tokens`` masks it) with the next likeliest, of an
echoed prompt's tokens, and ``prompt_logprobs``, and of the tokens
``logprob_token_ids`` name; streamed or whole alike, and the same through a
P/D pair as from one engine."""

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
from fake_engine.model import FakeModel, Processors
from fake_engine.testing import EngineSpec, fake_engines
from fake_engine.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, decode, encode


def test_the_models_pick_is_its_likeliest_token_in_a_distribution() -> None:
    model = FakeModel(EngineConfig())
    for digest in range(50):
        likeliest = model.logprobs(digest, 9, count=20)
        assert likeliest[0].token_id == model.next_token(digest, 9)
        assert [e.rank for e in likeliest] == list(range(1, 21))
        assert len({e.token_id for e in likeliest}) == 20
        assert all(a.logprob > b.logprob for a, b in itertools.pairwise(likeliest))
        assert sum(math.exp(e.logprob) for e in likeliest) < 1


def test_a_masked_pick_gives_way_to_the_likeliest_token_left() -> None:
    # As vLLM's min-tokens processor: masked tokens' logits go to -inf after
    # the raw logprobs are taken, so greedy sampling takes the likeliest
    # token left and the logprobs still rank the masked ones first.
    model = FakeModel(EngineConfig())
    for digest in range(50):
        first, second, third = model.logprobs(digest, 9, count=3)
        masked = Processors(masked=frozenset({first.token_id, second.token_id}))
        assert model.next_token(digest, 9, masked) == third.token_id
        assert model.logprobs(digest, 9, count=0, processors=masked) == [third]
        assert model.logprobs(digest, 9, count=2, processors=masked) == [
            third,
            first,
            second,
        ]
        assert model.logprobs(digest, 9, count=3, processors=masked) == [
            third,
            first,
            second,
        ]
        requested = model.requested_logprobs(
            digest, 9, token_ids=[first.token_id], processors=masked
        )
        assert requested == [third, first]


def test_with_every_ranked_token_masked_the_likeliest_of_the_rest_is_taken() -> None:
    model = FakeModel(EngineConfig())
    for digest in range(20):
        ranked = frozenset(e.token_id for e in model.logprobs(digest, 9, count=21))
        masked = Processors(masked=ranked)
        token = model.next_token(digest, 9, masked)
        (sampled,) = model.logprobs(digest, 9, count=0, processors=masked)
        assert sampled.token_id == token and token not in ranked
        assert sampled.rank > 21
        rest = model.requested_logprobs(
            digest, 9, token_ids=[t for t in range(VOCAB_SIZE) if t not in ranked]
        )
        assert sampled.logprob == max(e.logprob for e in rest[1:])
        # Every token masked: argmax over -inf logits takes token 0.
        everything = Processors(masked=frozenset(range(VOCAB_SIZE)))
        assert model.next_token(digest, 9, everything) == 0
        # Allowed, the pick stays.
        kept = Processors(allowed=ranked)
        assert model.next_token(digest, 9, kept) == model.next_token(digest, 9)


def test_a_logit_bias_moves_the_pick_by_logprob_plus_bias() -> None:
    # As vLLM's logit-bias processor: the bias is added to the logits after
    # the raw logprobs are taken; a bias of 100 takes any token, one of -100
    # drops the pick for the next likeliest.
    model = FakeModel(EngineConfig())
    for digest in range(50):
        first, second = model.logprobs(digest, 9, count=2)
        for token in (EOS_TOKEN_ID, ord("Q"), second.token_id):
            forced = Processors(bias={token: 100.0})
            assert model.next_token(digest, 9, forced) == token
        dropped = Processors(bias={first.token_id: -100.0})
        assert model.next_token(digest, 9, dropped) == second.token_id
        assert model.logprobs(digest, 9, count=1, processors=dropped) == [
            second,
            first,
        ]
        # Just enough to overtake the pick, and not quite.
        gap = first.logprob - second.logprob
        ahead = Processors(bias={second.token_id: gap * 1.01})
        behind = Processors(bias={second.token_id: gap * 0.99})
        assert model.next_token(digest, 9, ahead) == second.token_id
        assert model.next_token(digest, 9, behind) == first.token_id


def test_allowed_token_ids_keep_the_likeliest_of_them() -> None:
    model = FakeModel(EngineConfig())
    for digest in range(50):
        _, second, third = model.logprobs(digest, 9, count=3)
        allowed = Processors(allowed=frozenset({third.token_id, second.token_id}))
        assert model.next_token(digest, 9, allowed) == second.token_id
        only = Processors(allowed=frozenset({ord("Q")}))
        assert model.next_token(digest, 9, only) == ord("Q")
        # Masked too: nothing is left, and argmax takes token 0.
        both = Processors(allowed=frozenset({ord("Q")}), masked=frozenset({ord("Q")}))
        assert model.next_token(digest, 9, both) == 0


def test_equal_tokens_go_to_the_lowest_id_as_argmax() -> None:
    model = FakeModel(EngineConfig())
    digest = 7
    ranked = {e.token_id for e in model.logprobs(digest, 9, count=21)}
    unranked = [t for t in range(VOCAB_SIZE) if t not in ranked]
    # Tokens past the ranked ones share 100 log probabilities: two of them
    # tie.
    by_logprob: dict[float, list[int]] = {}
    for entry in model.requested_logprobs(digest, 9, token_ids=unranked)[1:]:
        by_logprob.setdefault(entry.logprob, []).append(entry.token_id)
    low, high = next(ids for ids in by_logprob.values() if len(ids) > 1)[:2]
    assert low < high
    allowed = Processors(allowed=frozenset({high, low}))
    assert model.next_token(digest, 9, allowed) == low
    biased = Processors(bias={high: 100.0, low: 100.0})
    assert model.next_token(digest, 9, biased) == low


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
        # A token the model never picks (a capital, ";") ranks past the 21
        # likeliest it keeps ranks of.
        if not chr(token_id).islower() and token_id != ord(" "):
            assert entries[0].rank > 21


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


async def _streamed_logprobs_join_to_whole(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> dict[str, Any]:
    """The logprobs of ``body``'s reply, checked equal to its stream's chunks'
    logprobs joined."""
    _, whole = await post(session, url, body)
    _, events = await stream(session, url, {**body, "stream": True})
    pieces = [
        e["choices"][0]["logprobs"]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["logprobs"]
    ]
    want = whole["choices"][0]["logprobs"]
    joined = {k: [x for p in pieces for x in p[k]] for k in want}
    assert joined == want, url
    return want


async def test_a_stream_carries_the_same_logprobs_chunk_by_chunk(
    session: aiohttp.ClientSession, url: str
) -> None:
    for route, body in (
        (COMPLETIONS, completion_body(logprobs=2, echo=True)),
        (CHAT, chat_body(logprobs=True, top_logprobs=2)),
    ):
        await _streamed_logprobs_join_to_whole(session, url + route, body)


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


async def test_a_chat_echo_gets_prompt_logprobs_of_its_top_logprobs(
    session: aiohttp.ClientSession, url: str
) -> None:
    # vLLM's ChatCompletionRequest.to_sampling_params: with echo and no
    # prompt_logprobs, the prompt is scored top_logprobs wide.
    body = chat_body(logprobs=True, top_logprobs=3)
    _, echoed = await post(session, url + CHAT, {**body, "echo": True})
    assert echoed["prompt_logprobs"][0] is None
    assert all(len(scores) in (3, 4) for scores in echoed["prompt_logprobs"][1:])
    _, plain = await post(session, url + CHAT, body)
    assert plain["prompt_logprobs"] is None


async def test_a_pd_pair_gives_the_logprobs_one_engine_gives(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(
        EngineSpec(role=Role.PRODUCER), EngineSpec(role=Role.CONSUMER), EngineSpec()
    ) as (prefill, decode, alone):
        for route, body in (
            (COMPLETIONS, completion_body(logprobs=2)),
            # The requested tokens' logprobs too (logprob_token_ids).
            (COMPLETIONS, completion_body(logprobs=1, logprob_token_ids=REQUESTED)),
            (CHAT, chat_body(logprobs=True, logprob_token_ids=REQUESTED)),
        ):
            _, want = await post(session, alone + route, body)
            status, got = await pd(session, prefill, decode, route, body)
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


# Tokens asked for by id: two letters the model writes, a byte that is no
# UTF-8 (its text is U+FFFD), EOS, and a letter again (listed once).
REQUESTED = [ord("e"), ord("t"), 200, EOS_TOKEN_ID, ord("e")]


def requested_texts(token: str) -> list[str]:
    """The tokens a position's top logprobs name, in vLLM's order: the
    generated one, then each requested one once."""
    return list(dict.fromkeys([token, *(_text(i) for i in REQUESTED)]))


def _text(token_id: int) -> str:
    return decode([token_id], skip_special_tokens=False)


def test_requested_logprobs_follow_the_pick_in_the_order_asked() -> None:
    model = FakeModel(EngineConfig())
    for digest in range(50):
        pick = model.logprobs(digest, 9, count=1)[0]
        top = {e.token_id: e for e in model.logprobs(digest, 9, count=20)}
        got = model.requested_logprobs(digest, 9, token_ids=REQUESTED)
        assert got[0].token_id == pick.token_id and got[0].logprob == pick.logprob
        assert [e.token_id for e in got] == list(
            dict.fromkeys([pick.token_id, *REQUESTED])
        )
        for entry in got:
            # vLLM's ranks: the pick's own, then each requested token's
            # (last) place in the list.
            places = [i for i, t in enumerate(REQUESTED, 1) if t == entry.token_id]
            assert entry.rank == (places[-1] if places else 1)
            # A token's logprob is the one its top-k entry has.
            if entry.token_id in top:
                assert entry.logprob == top[entry.token_id].logprob
            assert entry.logprob < 0


async def test_logprob_token_ids_are_answered_for_each_generated_token(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = completion_body(logprobs=1, logprob_token_ids=REQUESTED)
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 200
    logprobs = answer["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == text_of(answer)
    _, plain = await post(session, url + COMPLETIONS, completion_body(logprobs=20))
    assert text_of(plain) == text_of(answer)
    for token, logprob, top, rivals in zip(
        logprobs["tokens"],
        logprobs["token_logprobs"],
        logprobs["top_logprobs"],
        plain["choices"][0]["logprobs"]["top_logprobs"],
        strict=True,
    ):
        # Every requested token, whatever ``logprobs`` asks (1 here).
        assert list(top) == requested_texts(token)
        assert top[token] == logprob
        # The same logprobs as a request for the top ones gives.
        assert all(top[t] == rivals[t] for t in top.keys() & rivals.keys())


async def test_chat_lists_every_requested_token_after_the_generated_one(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = chat_body(logprobs=True, top_logprobs=1, logprob_token_ids=REQUESTED)
    status, answer = await post(session, url + CHAT, body)
    assert status == 200
    content = answer["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == text_of(answer)
    for entry in content:
        listed = entry["top_logprobs"]
        assert [t["token"] for t in listed] == requested_texts(entry["token"])
        assert listed[0]["logprob"] == entry["logprob"]
        assert all(t["bytes"] == list(t["token"].encode()) for t in listed)


async def test_a_stream_carries_the_requested_logprobs_chunk_by_chunk(
    session: aiohttp.ClientSession, url: str
) -> None:
    for route, body in (
        (COMPLETIONS, completion_body(logprobs=0, logprob_token_ids=REQUESTED)),
        (CHAT, chat_body(logprobs=True, logprob_token_ids=REQUESTED)),
    ):
        want = await _streamed_logprobs_join_to_whole(session, url + route, body)
        if route == CHAT:
            for entry in want["content"]:
                listed = [t["token"] for t in entry["top_logprobs"]]
                assert listed == requested_texts(entry["token"])


async def test_an_echo_with_logprob_token_ids_lists_all_of_each_prompt_tokens_entries(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = completion_body(
        echo=True, logprobs=1, prompt_logprobs=3, logprob_token_ids=REQUESTED
    )
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 200
    choice = answer["choices"][0]
    tops = choice["logprobs"]["top_logprobs"]
    # vLLM's return_all: a prompt token's own entry and its 3 likeliest (the
    # token once), not ``logprobs`` + 1 of them.
    for top, scores in zip(tops[1:70], choice["prompt_logprobs"][1:], strict=True):
        assert list(top.values()) == [s["logprob"] for s in scores.values()]
        assert len(top) in (3, 4)
    for token, top in zip(choice["logprobs"]["tokens"][70:], tops[70:], strict=True):
        assert list(top) == requested_texts(token)


async def test_logprob_token_ids_lift_vllms_limit_on_top_logprobs(
    session: aiohttp.ClientSession, url: str
) -> None:
    """vLLM's routes pass no top logprobs to its sampler with
    ``logprob_token_ids``: a count past --max-logprobs goes unchecked."""
    for route, body in (
        (COMPLETIONS, completion_body(logprobs=50, logprob_token_ids=[101])),
        (COMPLETIONS, completion_body(logprobs=-1, logprob_token_ids=[101])),
        (CHAT, chat_body(logprobs=True, top_logprobs=25, logprob_token_ids=[101])),
    ):
        status, answer = await post(session, url + route, body)
        assert status == 200, answer
        assert answer["choices"][0]["logprobs"] is not None


async def test_a_null_top_logprobs_reads_as_zero_as_vllm_reads_it(
    session: aiohttp.ClientSession, url: str
) -> None:
    """vLLM's ``TopLogprobsParam``: null is 0, so logprobs still come."""
    body = chat_body(logprobs=True, top_logprobs=None)
    _, answer = await post(session, url + CHAT, body)
    content = answer["choices"][0]["logprobs"]["content"]
    assert content and all(entry["top_logprobs"] == [] for entry in content)
    _, answer = await post(session, url + CHAT, {**body, "logprob_token_ids": [101]})
    content = answer["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) in (1, 2) for entry in content)


async def test_an_empty_logprob_token_ids_asks_for_nothing(
    session: aiohttp.ClientSession, url: str
) -> None:
    _, want = await post(session, url + COMPLETIONS, completion_body(logprobs=1))
    _, got = await post(
        session, url + COMPLETIONS, completion_body(logprobs=1, logprob_token_ids=[])
    )
    assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]
    status, answer = await post(session, url + CHAT, chat_body(logprob_token_ids=[]))
    assert status == 200 and answer["choices"][0]["logprobs"] is None


async def test_prompt_logprob_token_ids_are_ignored_as_vllm_ignores_unknown_fields(
    session: aiohttp.ClientSession, url: str
) -> None:
    """vLLM 0.32's OpenAI requests have no such field (only its
    token-in-token-out route takes it, in ``SamplingParams``)."""
    unknown = {"prompt_logprob_token_ids": [[101, 102]], "prompt_logprob_start": 0}
    for route, make in ((COMPLETIONS, completion_body), (CHAT, chat_body)):
        _, want = await post(session, url + route, make())
        status, got = await post(session, url + route, make(**unknown))
        assert status == 200
        assert got["choices"] == want["choices"]
        assert got.get("prompt_logprobs") is None


@pytest.mark.parametrize(
    ("route", "fields", "param", "message"),
    [
        (
            CHAT,
            {"logprob_token_ids": [101]},
            "logprob_token_ids",
            "when using `logprob_token_ids`, `logprobs` must be set to true. "
            "(parameter=logprob_token_ids)",
        ),
        (
            COMPLETIONS,
            {"logprob_token_ids": [101]},
            "logprob_token_ids",
            "when using `logprob_token_ids`, `logprobs` must be set. "
            "(parameter=logprob_token_ids)",
        ),
        (
            CHAT,
            {
                "use_beam_search": True,
                "n": 2,
                "logprobs": True,
                "logprob_token_ids": [101],
            },
            "logprob_token_ids",
            "`logprob_token_ids` is not supported with beam search. "
            "(parameter=logprob_token_ids)",
        ),
        # Checked before the beam search's refusal of an echo's logprobs.
        (
            COMPLETIONS,
            {
                "use_beam_search": True,
                "n": 2,
                "echo": True,
                "logprobs": 1,
                "logprob_token_ids": [101],
            },
            "logprob_token_ids",
            "`logprob_token_ids` is not supported with beam search. "
            "(parameter=logprob_token_ids)",
        ),
        (
            COMPLETIONS,
            {"echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [101]},
            "logprob_token_ids",
            "`logprob_token_ids` is not supported when `echo=True` and "
            "`max_tokens=0` because no output tokens are generated. "
            "(parameter=logprob_token_ids)",
        ),
        (
            COMPLETIONS,
            {"logprobs": 1, "logprob_token_ids": list(range(129))},
            "logprob_token_ids",
            "Requested logprob_token_ids of length 129, which is greater than max "
            "allowed: 128 (parameter=logprob_token_ids, value=129)",
        ),
        (
            CHAT,
            {"logprobs": True, "logprob_token_ids": [-1, 5, 257]},
            "logprob_token_ids",
            "token_id(s) [-1, 257] in logprob_token_ids contain out-of-vocab token "
            "ids. Vocabulary size: 257 (parameter=logprob_token_ids, "
            "value=[-1, 257])",
        ),
        # The requested tokens are checked before the prompt's logprobs.
        (
            COMPLETIONS,
            {"logprobs": 1, "prompt_logprobs": 25, "logprob_token_ids": [-1]},
            "logprob_token_ids",
            "token_id(s) [-1] in logprob_token_ids contain out-of-vocab token ids. "
            "Vocabulary size: 257 (parameter=logprob_token_ids, value=[-1])",
        ),
        (
            COMPLETIONS,
            {"logprobs": "x", "logprob_token_ids": [101]},
            "logprobs",
            "`logprobs` must be an integer. (parameter=logprobs, value=x)",
        ),
    ],
)
async def test_logprob_token_ids_vllm_refuses_are_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    route: str,
    fields: dict[str, Any],
    param: str,
    message: str,
) -> None:
    body = (completion_body if route == COMPLETIONS else chat_body)(**fields)
    status, answer = await post(session, url + route, body)
    assert status == 400
    assert answer["error"] == {
        "message": message,
        "type": "BadRequestError",
        "param": param,
        "code": 400,
    }
