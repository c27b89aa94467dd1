"""``/tokenize`` and ``/detokenize`` as vLLM 0.32 serves them
(``vllm/entrypoints/serve/tokenize``): a prompt's ids, or a conversation's as
a chat request renders it, and the text of ids."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from fake_engine_helpers import CHAT, COMPLETIONS, MAX_MODEL_LEN, chat_body, post

from fake_engine.config import EngineConfig
from fake_engine.tokenizer import EOS_TEXT, EOS_TOKEN_ID, VOCAB_SIZE

MODEL = EngineConfig().model

MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
CONVERSATION = [*MESSAGES, {"role": "assistant", "content": "Foxes"}]


async def test_tokenize_gives_a_prompts_ids_and_the_context_length(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(session, url + "/tokenize", {"prompt": "héllo"})
    assert status == 200
    ids = list("héllo".encode())
    assert answer == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": None,
    }


async def test_tokenize_names_each_tokens_text_when_asked(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = {"prompt": "fox", "return_token_strs": True}
    status, answer = await post(session, url + "/tokenize", body)
    assert status == 200
    assert answer["token_strs"] == ["f", "o", "x"]


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"messages": MESSAGES}, id="generation-prompt"),
        pytest.param(
            {"messages": MESSAGES, "add_generation_prompt": False},
            id="no-generation-prompt",
        ),
        pytest.param(
            {
                "messages": CONVERSATION,
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            id="continuation",
        ),
        # A body with both is the member that sets more fields: messages.
        pytest.param({"messages": MESSAGES, "prompt": "x"}, id="with-a-prompt"),
    ],
)
async def test_tokenize_counts_a_conversation_as_a_chat_completion_prefills_it(
    session: aiohttp.ClientSession, url: str, fields: dict[str, Any]
) -> None:
    status, answer = await post(session, url + "/tokenize", fields)
    assert status == 200
    chat = {k: v for k, v in fields.items() if k != "prompt"}
    status, completion = await post(session, url + CHAT, chat_body(**chat))
    assert status == 200
    assert answer["count"] == completion["usage"]["prompt_tokens"]
    assert answer["count"] == len(answer["tokens"])


async def test_tokenize_counts_a_prompt_as_a_completion_prefills_it(
    session: aiohttp.ClientSession, url: str
) -> None:
    prompt = "The quick brown fox"
    _, answer = await post(session, url + "/tokenize", {"prompt": prompt})
    body = {"prompt": answer["tokens"], "max_tokens": 2, "temperature": 0}
    _, by_ids = await post(session, url + COMPLETIONS, body)
    _, by_text = await post(session, url + COMPLETIONS, {**body, "prompt": prompt})
    assert by_ids["usage"] == by_text["usage"]
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


@pytest.mark.parametrize(
    "text", ["", "plain", "héllo wörld ✓", "line\nbreak", "emoji 🦊"]
)
async def test_detokenize_gives_back_the_text_tokenize_read(
    session: aiohttp.ClientSession, url: str, text: str
) -> None:
    _, answer = await post(session, url + "/tokenize", {"prompt": text})
    status, back = await post(session, url + "/detokenize", answer)
    assert status == 200
    assert back == {"prompt": text}


async def test_detokenize_shows_special_tokens_and_leaves_out_unknown_ids(
    session: aiohttp.ClientSession, url: str
) -> None:
    tokens = [ord("a"), EOS_TOKEN_ID, VOCAB_SIZE, 10**9, ord("b")]
    status, answer = await post(session, url + "/detokenize", {"tokens": tokens})
    assert status == 200
    assert answer == {"prompt": f"a{EOS_TEXT}b"}


REFUSALS = [
    pytest.param(
        "/tokenize",
        {},
        400,
        "Bad Request",
        "body.prompt",
        "2 validation errors:\n  {'type': 'missing', 'loc': 'body.prompt', "
        "'msg': 'Field required', 'input': '<dict of 0 items>'}\n  {'type': "
        "'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': "
        "'<dict of 0 items>'}",
        id="neither-prompt-nor-messages",
    ),
    pytest.param(
        "/tokenize",
        {"prompt": [1, 2]},
        400,
        "Bad Request",
        "body.prompt",
        "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.prompt', "
        "'msg': 'Input should be a valid string', 'input': '<list of 2 items>'}"
        "\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field "
        "required', 'input': '<dict of 1 items>'}",
        id="ids-as-prompt",
    ),
    pytest.param(
        "/tokenize",
        [1],
        400,
        "Bad Request",
        "body",
        "2 validation errors:\n"
        + "\n".join(
            [
                "  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
                "'Input should be a valid dictionary or object to extract "
                "fields from', 'input': '<list of 1 items>'}"
            ]
            * 2
        ),
        id="not-an-object",
    ),
    pytest.param(
        "/tokenize",
        {"model": "nope", "prompt": "x"},
        404,
        "NotFoundError",
        "model",
        f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        id="unknown-model",
    ),
    pytest.param(
        "/tokenize",
        {
            "messages": CONVERSATION,
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        400,
        "BadRequestError",
        None,
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        id="continuation-and-generation-prompt",
    ),
    pytest.param(
        "/tokenize",
        {"messages": CONVERSATION, "continue_final_message": True},
        400,
        "BadRequestError",
        None,
        "continue_final_message and add_generation_prompt are not compatible. "
        "Use continue_final_message when you want the model to continue the "
        "final message, and add_generation_prompt when you want to add a header "
        "that will prompt it to start a new assistant message instead.",
        id="continuation-beside-the-default-generation-prompt",
    ),
    pytest.param(
        "/tokenize",
        {"messages": []},
        400,
        "BadRequestError",
        None,
        "Cannot apply chat template to an empty conversation. Provide at least "
        "one message.",
        id="empty-conversation",
    ),
    pytest.param(
        "/tokenize",
        {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "x"}},
        400,
        "BadRequestError",
        None,
        "Chat template is passed with request, but --trust-request-chat-template "
        "is not set. Refused request with untrusted chat template.",
        id="chat-template",
    ),
    pytest.param(
        "/tokenize",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                }
            ]
        },
        400,
        "BadRequestError",
        None,
        f"{MODEL} is not a multimodal model",
        id="image",
    ),
    pytest.param(
        "/detokenize",
        {"tokens": [-1]},
        400,
        "Bad Request",
        "body.tokens.0",
        "1 validation error:\n  {'type': 'greater_than_equal', 'loc': "
        "'body.tokens.0', 'msg': 'Input should be greater than or equal to 0', "
        "'input': '-1', 'ctx': {'ge': 0}}",
        id="negative-id",
    ),
    pytest.param(
        "/detokenize",
        {"tokens": [2**63]},
        400,
        "Bad Request",
        "body.tokens.0",
        "1 validation error:\n  {'type': 'less_than_equal', 'loc': "
        "'body.tokens.0', 'msg': 'Input should be less than or equal to "
        "9223372036854775807', 'input': '9223372036854775808', 'ctx': {'le': "
        "9223372036854775807}}",
        id="id-past-int64",
    ),
    pytest.param(
        "/detokenize",
        {},
        400,
        "Bad Request",
        "body.tokens",
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.tokens', "
        "'msg': 'Field required', 'input': '<dict of 0 items>'}",
        id="no-tokens",
    ),
    pytest.param(
        "/detokenize",
        [1],
        400,
        "Bad Request",
        "body",
        "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', "
        "'msg': 'Input should be a valid dictionary or object to extract fields "
        "from', 'input': '<list of 1 items>'}",
        id="detokenize-not-an-object",
    ),
    pytest.param(
        "/detokenize",
        {"model": "nope", "tokens": [1]},
        404,
        "NotFoundError",
        "model",
        f"The model `nope` does not exist. Valid aliases: {MODEL}.",
        id="detokenize-unknown-model",
    ),
]


# vllm/entrypoints/serve/tokenize/protocol.py and serving.py: FastAPI
# validates the body (a union of a prompt's and a conversation's), then
# _check_model, then the chat template and the renderer.
@pytest.mark.parametrize(
    ("path", "body", "status", "err_type", "param", "message"), REFUSALS
)
async def test_a_body_vllm_refuses_is_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: Any,
    status: int,
    err_type: str,
    param: str | None,
    message: str,
) -> None:
    got_status, answer = await post(session, url + path, body)
    assert (got_status, answer) == (
        status,
        {
            "error": {
                "message": message,
                "type": err_type,
                "param": param,
                "code": status,
            }
        },
    )


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_tokenize_routes_take_only_post(
    session: aiohttp.ClientSession, url: str, path: str
) -> None:
    async with session.get(url + path) as response:
        assert response.status == 405
        assert await response.json() == {"detail": "Method Not Allowed"}
