"""The fake engine answers as vLLM 0.32's OpenAI server does where a proxy or
a demo user can tell: refused output budgets, the message and ``param`` of
vLLM's own validation errors, and streams of requests that end before any
output. Each test names the vLLM code it follows."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from fake_engine_helpers import (
    CHAT,
    COMPLETIONS,
    MAX_MODEL_LEN,
    PROMPT,
    chat_body,
    completion_body,
    post,
    post_bytes,
    stream,
    text_of,
)

from fake_engine.testing import EngineSpec, fake_engines
from fake_engine.tokenizer import VOCAB_SIZE

Body = Callable[..., dict[str, Any]]


def vllm_error(answer: dict, err_type: str, param: str | None) -> str:
    """The message of vLLM's error JSON, after checking its type and param."""
    assert list(answer) == ["error"]
    error = answer["error"]
    assert (error["type"], error["code"], error["param"]) == (err_type, 400, param)
    message = error["message"]
    assert isinstance(message, str)
    return message


# vllm/renderers/params.py TokenizeParams.__post_init__: an output budget
# above max_model_len is refused (below it, get_max_tokens clamps it).
@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        (COMPLETIONS, "max_tokens", completion_body),
        (CHAT, "max_tokens", chat_body),
        (CHAT, "max_completion_tokens", chat_body),
    ],
)
async def test_output_budget_above_max_model_len_is_refused_with_its_param(
    session: aiohttp.ClientSession, url: str, path: str, field: str, body: Body
) -> None:
    request = body(**{field: MAX_MODEL_LEN + 1})
    if field == "max_completion_tokens":
        request.pop("max_tokens")
    status, answer = await post(session, url + path, request)
    assert status == 400
    message = vllm_error(answer, "BadRequestError", field)
    assert message == (
        f"{field}={MAX_MODEL_LEN + 1} cannot be greater than "
        f"max_model_len={MAX_MODEL_LEN}. Please request fewer output tokens. "
        f"(parameter={field}, value={MAX_MODEL_LEN + 1})"
    )


async def test_output_budget_up_to_max_model_len_is_clamped_to_the_room_left(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = completion_body(max_tokens=MAX_MODEL_LEN)
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 200
    assert answer["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(PROMPT)
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_min_tokens_may_take_all_the_room_left(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = {
        "prompt": [VOCAB_SIZE - 1] * (MAX_MODEL_LEN - 56),
        "max_tokens": 100,
        "min_tokens": 56,
    }
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 200
    assert answer["usage"]["completion_tokens"] == 56


# vllm/exceptions.py VLLMValidationError.__str__ appends the parameter and
# value; create_error_response answers with str(exc).
@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        pytest.param(
            {"max_tokens": 3},
            "prompt",
            "Either prompt or prompt_embeds must be provided and non-empty. "
            "(parameter=prompt)",
            id="no-prompt",
        ),
        pytest.param(
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "Stream options can only be defined when `stream=True`. "
            "(parameter=stream_options)",
            id="stream-options-without-stream",
        ),
        pytest.param(
            {"prompt": "x", "max_tokens": -1},
            "max_tokens",
            "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)",
            id="negative-max-tokens",
        ),
        # SamplingParams._verify_args names no parameter for this one.
        pytest.param(
            {"prompt": "x", "min_tokens": -1},
            None,
            "min_tokens must be greater than or equal to 0, got -1.",
            id="negative-min-tokens",
        ),
        pytest.param(
            {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
            None,
            "min_tokens must be less than or equal to max_tokens=2, got 3.",
            id="min-tokens-above-max-tokens",
        ),
        # An echo without generation samples one token (CompletionRequest's
        # to_sampling_params), which min_tokens is checked against.
        pytest.param(
            {"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 2},
            None,
            "min_tokens must be less than or equal to max_tokens=1, got 2.",
            id="min-tokens-above-an-echo-without-generation",
        ),
        pytest.param(
            {"prompt": [1, 300]},
            "prompt",
            "Token id 300 is out of vocabulary (parameter=prompt)",
            id="token-out-of-vocabulary",
        ),
        pytest.param(
            {"prompt": [65] * 300},
            "input_tokens",
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
            "However, your prompt contains 300 input tokens, which exceeds this "
            "limit even without any output tokens. Please reduce the length of "
            "the input prompt. (parameter=input_tokens, value=300)",
            id="token-prompt-too-long",
        ),
        # A prompt of max_model_len tokens passes _token_len_check (it is not
        # over), and get_max_tokens then leaves no output token.
        pytest.param(
            {"prompt": [65] * MAX_MODEL_LEN},
            "max_tokens",
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            id="token-prompt-filling-the-context",
        ),
        # get_max_tokens clamps max_tokens to the room left (56 here), which
        # SamplingParams checks min_tokens against.
        pytest.param(
            {
                "prompt": [65] * (MAX_MODEL_LEN - 56),
                "max_tokens": 100,
                "min_tokens": 57,
            },
            None,
            "min_tokens must be less than or equal to max_tokens=56, got 57.",
            id="min-tokens-above-the-room-left",
        ),
        pytest.param(
            {"prompt": [1, VOCAB_SIZE]},
            "prompt",
            f"Token id {VOCAB_SIZE} is out of vocabulary (parameter=prompt)",
            id="token-just-past-the-vocabulary",
        ),
        # A text prompt is tokenized to at most max_model_len + 1 tokens
        # (TokenizeParams.get_encode_kwargs), so vLLM counts "at least" those.
        pytest.param(
            {"prompt": "x" * 300},
            "input_tokens",
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
            f"However, your prompt contains at least {MAX_MODEL_LEN + 1} input "
            "tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={MAX_MODEL_LEN + 1})",
            id="text-prompt-too-long",
        ),
        # SamplingParams.from_optional: keys int() cannot take (it takes
        # " 8" and "1_0").
        pytest.param(
            {"prompt": "x", "logit_bias": {"x": 1, " 8": 2, "1_0": 3, "1.5": 4}},
            "logit_bias",
            "logit_bias contains key(s) that cannot be converted to integer "
            "token IDs: ['x', '1.5'] (parameter=logit_bias, value=['x', '1.5'])",
            id="logit-bias-key-no-integer",
        ),
        # ... before SamplingParams checks any value.
        pytest.param(
            {"prompt": "x", "n": 0, "temperature": -1, "logit_bias": {"x": 1}},
            "logit_bias",
            "logit_bias contains key(s) that cannot be converted to integer "
            "token IDs: ['x'] (parameter=logit_bias, value=['x'])",
            id="logit-bias-key-checked-first",
        ),
        # SamplingParams.verify: logit_bias, then stop_token_ids, then
        # allowed_token_ids.
        pytest.param(
            {
                "prompt": "x",
                "logit_bias": {str(VOCAB_SIZE): 1, "-1": 2, "0": 3},
                "stop_token_ids": [VOCAB_SIZE],
            },
            "logit_bias",
            f"token_id(s) [{VOCAB_SIZE}, -1] in logit_bias contain out-of-vocab "
            f"token ids. Vocabulary size: {VOCAB_SIZE} "
            f"(parameter=logit_bias, value=[{VOCAB_SIZE}, -1])",
            id="out-of-vocab-logit-bias",
        ),
        pytest.param(
            {
                "prompt": "x",
                "stop_token_ids": [0, VOCAB_SIZE - 1, VOCAB_SIZE],
                "allowed_token_ids": [],
            },
            "stop_token_ids",
            f"token_id(s) [{VOCAB_SIZE}] in stop_token_ids contain out-of-vocab "
            f"token ids. Vocabulary size: {VOCAB_SIZE} "
            f"(parameter=stop_token_ids, value=[{VOCAB_SIZE}])",
            id="out-of-vocab-stop-token-ids",
        ),
        pytest.param(
            {"prompt": "x", "allowed_token_ids": []},
            "allowed_token_ids",
            "allowed_token_ids is not None and empty! "
            "(parameter=allowed_token_ids, value=[])",
            id="empty-allowed-token-ids",
        ),
        pytest.param(
            {"prompt": "x", "allowed_token_ids": [0, VOCAB_SIZE, -1]},
            "allowed_token_ids",
            "allowed_token_ids contains out-of-vocab token id! "
            f"(parameter=allowed_token_ids, value=[{VOCAB_SIZE}, -1])",
            id="out-of-vocab-allowed-token-ids",
        ),
        # SamplingParams: duplicates dropped; an empty word (no parameter
        # named), then words as update_from_tokenizer encodes them.
        pytest.param(
            {"prompt": "x", "bad_words": ["a", "", "a", ""]},
            None,
            "bad_words cannot contain an empty string. Got bad_words=['a', '']",
            id="empty-bad-word",
        ),
        pytest.param(
            {"prompt": "x", "bad_words": [""], "temperature": 0, "n": 2},
            None,
            "bad_words cannot contain an empty string. Got bad_words=['']",
            id="empty-bad-word-before-greedy-n",
        ),
        pytest.param(
            {"prompt": "x", "bad_words": ["a", "  ", "a"]},
            "bad_words",
            "bad_words entries must tokenize to at least one token. "
            "(parameter=bad_words, value=['a', '  '])",
            id="blank-bad-word",
        ),
        pytest.param(
            {"prompt": "x", "bad_words": [str(i) for i in range(129)]},
            "bad_words",
            "Too many bad words after tokenization: 129. The max number is 128. "
            f"(parameter=bad_words, value={[str(i) for i in range(129)]})",
            id="too-many-bad-words",
        ),
        # generate/base/protocol.py validate_cache_salt.
        pytest.param(
            {"prompt": "x", "cache_salt": ""},
            "cache_salt",
            "Parameter 'cache_salt' must be a non-empty string if provided. "
            "(parameter=cache_salt)",
            id="empty-cache-salt",
        ),
        pytest.param(
            {"prompt": "x", "cache_salt": "a/b"},
            "cache_salt",
            "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)",
            id="cache-salt-with-a-slash",
        ),
        pytest.param(
            {"prompt": "x", "cache_salt": "a" * 129},
            "cache_salt",
            "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)",
            id="long-cache-salt",
        ),
        # CompletionRequest.validate_prompt_list_length: a list of ids is one
        # prompt, whatever its length (this one too long for the context).
        pytest.param(
            {"prompt": [65] * 1025},
            "input_tokens",
            f"This model's maximum context length is {MAX_MODEL_LEN} tokens. "
            "However, your prompt contains 1025 input tokens, which exceeds this "
            "limit even without any output tokens. Please reduce the length of "
            "the input prompt. (parameter=input_tokens, value=1025)",
            id="1025-token-ids-are-one-prompt",
        ),
        pytest.param(
            {"prompt": ["x"] * 1025},
            "prompt",
            "prompt list length 1025 exceeds the maximum allowed count of 1024. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
            "environment variable. (parameter=prompt)",
            id="too-many-prompts",
        ),
        # renderers/params.py TokenizeParams: against the whole context.
        pytest.param(
            {"prompt": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1},
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens={MAX_MODEL_LEN + 1} cannot be greater than "
            f"max_model_len = {MAX_MODEL_LEN}. Please request a smaller "
            f"truncation size. (parameter=truncate_prompt_tokens, "
            f"value={MAX_MODEL_LEN + 1})",
            id="truncation-past-the-context",
        ),
        # A server without --enable-prompt-embeds (embed_utils).
        pytest.param(
            {"prompt_embeds": "AAAA"},
            "prompt_embeds",
            "You must set `--enable-prompt-embeds` to input `prompt_embeds`. "
            "(parameter=prompt_embeds)",
            id="prompt-embeds",
        ),
        # renderers/online_renderer.py render_completion, and the input
        # processor's refusal of an empty prompt: plain errors, the
        # parameter named apart only.
        pytest.param(
            {"prompt": "x", "suffix": ""},
            "suffix",
            "suffix is only supported for models with FIM completion rendering",
            id="suffix",
        ),
        pytest.param(
            {"prompt": [65, 66], "suffix": "x"},
            "suffix",
            "suffix requires text prompt input for FIM completion rendering",
            id="suffix-of-token-ids",
        ),
        pytest.param(
            {"prompt": "x", "suffix": "x", "echo": True},
            "suffix",
            "Echo is unsupported with suffix.",
            id="suffix-with-echo",
        ),
        pytest.param(
            {"prompt": "x", "suffix": "x", "truncate_prompt_tokens": 1},
            "suffix",
            "suffix is not supported with truncate_prompt_tokens",
            id="suffix-with-truncation",
        ),
        pytest.param(
            {"prompt": "x", "prompt_embeds": "AAAA", "echo": True},
            None,
            "Echo is unsupported with prompt embeds.",
            id="prompt-embeds-with-echo",
        ),
        pytest.param(
            {"prompt": []}, None, "You must pass at least one prompt", id="no-prompts"
        ),
        pytest.param(
            {"prompt": [[]]},
            None,
            "The decoder prompt cannot be empty",
            id="no-token-ids",
        ),
        pytest.param(
            {"prompt": "abc", "truncate_prompt_tokens": 0},
            None,
            "The decoder prompt cannot be empty",
            id="truncated-to-nothing",
        ),
    ],
)
async def test_a_completion_vllm_refuses_is_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    param: str | None,
    message: str,
) -> None:
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 400
    assert vllm_error(answer, "BadRequestError", param) == message


# A prompt's ids as vLLM truncates them: its end kept unless from the right;
# -1 leaves one token of the context for the output.
@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({"truncate_prompt_tokens": 3}, [67, 68, 69]),
        ({"truncate_prompt_tokens": 3, "truncation_side": "right"}, [65, 66, 67]),
        ({"truncate_prompt_tokens": 9}, [65, 66, 67, 68, 69]),
        ({"truncate_prompt_tokens": -1}, [65, 66, 67, 68, 69]),
    ],
    ids=["left", "right", "longer-than-the-prompt", "the-context"],
)
async def test_a_truncated_prompt_keeps_the_tokens_vllm_keeps(
    session: aiohttp.ClientSession, url: str, fields: dict[str, Any], kept: list[int]
) -> None:
    body = completion_body(prompt=[65, 66, 67, 68, 69], return_token_ids=True)
    status, answer = await post(session, url + COMPLETIONS, {**body, **fields})
    assert status == 200
    assert answer["choices"][0]["prompt_token_ids"] == kept
    assert answer["usage"]["prompt_tokens"] == len(kept)
    long_body = completion_body(prompt=[65] * MAX_MODEL_LEN, truncate_prompt_tokens=-1)
    status, answer = await post(session, url + COMPLETIONS, long_body)
    assert (status, answer["usage"]["prompt_tokens"]) == (200, MAX_MODEL_LEN - 1)
    _, chat = await post(
        session, url + CHAT, chat_body(truncate_prompt_tokens=3, return_token_ids=True)
    )
    assert len(chat["prompt_token_ids"]) == 3


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Yo"},
]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


# A chat request on a server started without tool, chat template or
# multimodal options: ChatCompletionRequest.check_tool_usage and
# check_generation_prompt (VLLMValidationError), then the renderer
# (render_chat: tool choice, then validate_chat_template), then the
# messages (a text-only model) and transformers' apply_chat_template.
@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        pytest.param(
            {"tools": []},
            "tools",
            "`tools` must not be an empty array. Either provide at least one tool "
            "or omit the field entirely. (parameter=tools)",
            id="no-tools",
        ),
        pytest.param(
            {"tool_choice": "auto"},
            "tool_choice",
            "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
            id="tool-choice-without-tools",
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": "sometimes"},
            "tool_choice",
            "Invalid value for `tool_choice`: sometimes! Only named tools, "
            '"none", "auto" or "required" are supported. (parameter=tool_choice)',
            id="unknown-tool-choice",
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "Expected field `name` in `function` in `tool_choice`! Correct usage: "
            '`{"type": "function", "function": {"name": "my_function"}}` '
            "(parameter=tool_choice.function.name)",
            id="named-tool-choice-without-a-name",
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": {"function": {"name": "g"}}},
            "tool_choice",
            "The tool specified in `tool_choice` does not match any of the "
            "specified `tools` (parameter=tool_choice)",
            id="named-tool-choice-of-no-tool",
        ),
        # Tools without a choice choose "auto".
        pytest.param(
            {"tools": TOOLS},
            None,
            '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set",
            id="tools",
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": "required"},
            None,
            'tool_choice="required" requires --tool-call-parser to be set',
            id="required-tool",
        ),
        pytest.param(
            {"tools": TOOLS, "tool_choice": {"function": {"name": "f"}}},
            None,
            'tool_choice=function "f" requires --tool-call-parser to be set',
            id="named-tool",
        ),
        pytest.param(
            {"chat_template_kwargs": {"chat_template": "{{ x }}"}},
            None,
            "Chat template is passed with request, but "
            "--trust-request-chat-template is not set. Refused request with "
            "untrusted chat template.",
            id="chat-template",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [IMAGE]}]},
            None,
            "kvguard/fake-model is not a multimodal model",
            id="image",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [AUDIO]}]},
            None,
            "kvguard/fake-model is not a multimodal model",
            id="audio",
        ),
        pytest.param(
            {"messages": []},
            None,
            "Cannot apply chat template to an empty conversation. Provide at "
            "least one message.",
            id="no-messages",
        ),
        # Before the generation prompt is looked at.
        pytest.param(
            {"messages": [], "continue_final_message": True},
            None,
            "Cannot apply chat template to an empty conversation. Provide at "
            "least one message.",
            id="no-messages-to-continue",
        ),
        pytest.param(
            {
                "messages": CONVERSATION,
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            None,
            "Cannot set both `continue_final_message` and `add_generation_prompt` "
            "to True.",
            id="continuation-and-generation-prompt",
        ),
        # The generation prompt by default: transformers refuses it.
        pytest.param(
            {"messages": CONVERSATION, "continue_final_message": True},
            None,
            "continue_final_message and add_generation_prompt are not compatible. "
            "Use continue_final_message when you want the model to continue the "
            "final message, and add_generation_prompt when you want to add a "
            "header that will prompt it to start a new assistant message instead.",
            id="continuation-beside-the-default-generation-prompt",
        ),
    ],
)
async def test_a_chat_vllm_could_not_render_is_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    fields: dict[str, Any],
    param: str | None,
    message: str,
) -> None:
    status, answer = await post(session, url + CHAT, chat_body(**fields))
    assert status == 400
    assert vllm_error(answer, "BadRequestError", param) == message


async def test_a_chat_vllm_renders_as_text_is_answered(
    session: aiohttp.ClientSession, url: str
) -> None:
    # Tools are taken where none is to be called, and a continuation
    # without the generation prompt.
    for fields in (
        {"tools": TOOLS, "tool_choice": "none"},
        {"tools": TOOLS, "tool_choice": None},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {
            "messages": CONVERSATION,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ):
        status, answer = await post(session, url + CHAT, chat_body(**fields))
        assert status == 200, (fields, answer)
    status, answer = await post(
        session, url + CHAT, chat_body(tools=[{"type": "function"}])
    )
    assert status == 400
    assert vllm_error(answer, "Bad Request", "body.tools.0.function") == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.tools.0.function', "
        "'msg': 'Field required', 'input': '<dict of 1 items>'}"
    )


# FastAPI's schema errors of vLLM's limits: at most four stop strings
# (VLLM_MAX_STOP_STRINGS), a truncation of -1 or more.
async def test_vllms_schema_limits_are_refused_as_validation_errors(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(
        session, url + CHAT, chat_body(stop=["a", "b", "c", "d", "e"])
    )
    assert status == 400
    assert vllm_error(answer, "Bad Request", "body.stop") == (
        "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop', "
        "'msg': 'Input should be a valid string', 'input': '<list of 5 items>'}\n"
        "  {'type': 'too_long', 'loc': 'body.stop', 'msg': 'List should have at "
        "most 4 items after validation, not 5', 'input': '<list of 5 items>', "
        "'ctx': {'field_type': 'List', 'max_length': 4, 'actual_length': 5}}"
    )
    status, answer = await post(
        session, url + COMPLETIONS, completion_body(truncate_prompt_tokens=-2)
    )
    assert status == 400
    assert vllm_error(answer, "Bad Request", "body.truncate_prompt_tokens") == (
        "1 validation error:\n  {'type': 'greater_than_equal', 'loc': "
        "'body.truncate_prompt_tokens', 'msg': 'Input should be greater than or "
        "equal to -1', 'input': '-2', 'ctx': {'ge': -1}}"
    )


# vllm/entrypoints/serve/exception_handling/handlers/validation.py
# validation_exception_handler: a body FastAPI cannot validate (schema, JSON,
# media type) is typed HTTPStatus.BAD_REQUEST.phrase, not "BadRequestError".
async def test_body_failing_fastapi_validation_is_typed_bad_request(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(session, url + COMPLETIONS, {"prompt": 7})
    assert status == 400
    assert vllm_error(answer, "Bad Request", "body.prompt")
    headers = {"Content-Type": "application/json"}
    status, answer = await post_bytes(
        session, url + COMPLETIONS, b'{"prompt": ', headers
    )
    assert status == 400
    message = vllm_error(answer, "Bad Request", answer["error"]["param"])
    assert "'input': '<dict of 0 items>'" in message
    # FastAPI validates a body with from_attributes: a list is no object.
    status, answer = await post(session, url + COMPLETIONS, [PROMPT])
    assert status == 400
    assert vllm_error(answer, "Bad Request", "body") == (
        "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', "
        "'msg': 'Input should be a valid dictionary or object to extract fields "
        "from', 'input': '<list of 1 items>'}"
    )
    status, answer = await post_bytes(session, url + COMPLETIONS, b"prompt=x")
    assert status == 400
    assert vllm_error(answer, "Bad Request", None) == (
        "1 validation error:\n  Unsupported Media Type: Only "
        "'application/json' is allowed"
    )


# vllm/entrypoints/openai/completion/serving.py completion_stream_generator
# and chat_completion/serving.py chat_completion_stream_generator skip an
# output with no text and no tokens while nothing was output yet, a final
# one included: a request aborted before its first token sends no chunk of
# its own (a chat stream only its role chunk), then usage and [DONE].
@pytest.mark.parametrize(
    ("path", "body", "before_done"),
    [
        (COMPLETIONS, completion_body, 0),
        (CHAT, chat_body, 1),
    ],
)
async def test_stream_aborted_before_its_first_token_sends_no_finish_chunk(
    session: aiohttp.ClientSession, path: str, body: Body, before_done: int
) -> None:
    # Prefilling the prompt takes seconds: the abort comes first.
    async with fake_engines(EngineSpec(prefill_tokens_per_s=10.0)) as urls:
        request = body(stream=True, stream_options={"include_usage": True})
        headers = {"X-Request-Id": "doomed"}

        async def abort_soon() -> None:
            await asyncio.sleep(0.3)
            await post(
                session,
                urls[0] + "/inference/v1/abort_requests",
                {"request_ids": ["doomed"]},
            )

        aborter = asyncio.create_task(abort_soon())
        async with session.post(
            urls[0] + path, json=request, headers=headers
        ) as response:
            raw = (await response.read()).decode()
        await aborter
    events = [frame.removeprefix("data: ") for frame in raw.split("\n\n")[:-1]]
    assert events[-1] == "[DONE]"
    assert '"abort"' not in raw
    assert len(events) == before_done + 2  # role chunk (chat), usage, [DONE]
    assert '"completion_tokens":0' in events[-2]


# vllm/entrypoints/serve/utils/fingerprint.py build_system_fingerprint (the
# default --fingerprint-mode full): "vllm-<version>[-tp<N>]-<hash8>", on
# whole responses, and in a stream on its last chunk: the usage chunk if
# there is one, else the finishing chunk (completion_stream_generator,
# chat_completion_stream_generator).
FINGERPRINT = re.compile(r"vllm-0\.32\.0-[0-9a-f]{8}")


@pytest.mark.parametrize(
    ("path", "body"), [(COMPLETIONS, completion_body), (CHAT, chat_body)]
)
async def test_responses_carry_vllms_system_fingerprint(
    session: aiohttp.ClientSession, url: str, path: str, body: Body
) -> None:
    _, whole = await post(session, url + path, body(max_tokens=3))
    fingerprint = whole["system_fingerprint"]
    assert FINGERPRINT.fullmatch(fingerprint)
    _, events = await stream(session, url + path, body(max_tokens=3, stream=True))
    assert [e.get("system_fingerprint") for e in events[:-1]] == [None] * (
        len(events) - 2
    ) + [fingerprint]
    options = {"include_usage": True}
    request = body(max_tokens=3, stream=True, stream_options=options)
    _, events = await stream(session, url + path, request)
    *chunks, usage, _ = events
    assert all("system_fingerprint" not in chunk for chunk in chunks)
    assert list(usage)[-2:] == ["usage", "system_fingerprint"]
    assert usage["system_fingerprint"] == fingerprint


async def test_system_fingerprint_names_tensor_parallelism(
    session: aiohttp.ClientSession,
) -> None:
    async with fake_engines(EngineSpec(tp_size=2)) as urls:
        _, whole = await post(session, urls[0] + COMPLETIONS, completion_body())
    assert re.fullmatch(r"vllm-0\.32\.0-tp2-[0-9a-f]{8}", whole["system_fingerprint"])


# vllm/entrypoints/openai/chat_completion/serving.py
# chat_completion_stream_generator sets completion_tokens_details (None
# without reasoning) in each chunk's continuous usage; completions do not.
async def test_chat_continuous_usage_names_completion_tokens_details(
    session: aiohttp.ClientSession, url: str
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    request = chat_body(max_tokens=2, stream=True, stream_options=options)
    _, events = await stream(session, url + CHAT, request)
    *chunks, usage, _ = events
    assert chunks and all(
        chunk["usage"]["completion_tokens_details"] is None
        and "completion_tokens_details" in chunk["usage"]
        for chunk in chunks
    )
    assert "completion_tokens_details" not in usage["usage"]
    request = completion_body(max_tokens=2, stream=True, stream_options=options)
    _, events = await stream(session, url + COMPLETIONS, request)
    assert all("completion_tokens_details" not in e["usage"] for e in events[:-1])


# vllm/v1/engine/output_processor.py RequestState.make_request_output: with a
# request's stream_interval of n, the first output goes at once, then one
# every n tokens, and the last one when the request finishes.
async def test_stream_interval_batches_tokens_into_chunks_as_vllm_does(
    session: aiohttp.ClientSession, url: str
) -> None:
    request = completion_body(
        max_tokens=10, stream=True, stream_interval=4, return_token_ids=True
    )
    _, events = await stream(session, url + COMPLETIONS, request)
    chunks = events[:-1]
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 4, 4, 1]
    _, whole = await post(session, url + COMPLETIONS, completion_body(max_tokens=10))
    assert "".join(c["choices"][0]["text"] for c in chunks) == text_of(whole)


# vllm/entrypoints/serve/exception_handling/handlers/validation.py
# _format_error: FastAPI's error dict (its "ctx" included), "input" as text
# cut at 200 characters; at most 10 errors listed.
async def test_a_validation_error_shows_its_context_and_its_input_as_text(
    session: aiohttp.ClientSession, url: str
) -> None:
    status, answer = await post(session, url + COMPLETIONS, completion_body(seed=2**63))
    assert status == 400
    assert vllm_error(answer, "Bad Request", "body.seed") == (
        "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'body.seed', "
        "'msg': 'Input should be less than or equal to 9223372036854775807', "
        "'input': '9223372036854775808', 'ctx': {'le': 9223372036854775807}}"
    )
    status, _ = await post(session, url + COMPLETIONS, completion_body(seed=2**63 - 1))
    assert status == 200


async def test_a_validation_errors_long_input_is_cut(
    session: aiohttp.ClientSession, url: str
) -> None:
    body = completion_body(temperature="7" * 150 + "x" * 150)
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 400
    message = vllm_error(answer, "Bad Request", "body.temperature")
    assert f"'input': '{'7' * 150 + 'x' * 50}...[truncated]'" in message


# One error per field here (a dict where a number or a bool goes).
BAD_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens"]
BAD_FIELDS += ["presence_penalty", "frequency_penalty", "repetition_penalty"]
BAD_FIELDS += ["min_tokens", "echo"]


@pytest.mark.parametrize("count", [10, 11, 12])
async def test_a_validation_error_lists_ten_errors_and_counts_the_rest(
    session: aiohttp.ClientSession, url: str, count: int
) -> None:
    body = completion_body(**{field: {"bad": 1} for field in BAD_FIELDS[:count]})
    status, answer = await post(session, url + COMPLETIONS, body)
    assert status == 400
    param = answer["error"]["param"]
    lines = vllm_error(answer, "Bad Request", param).split("\n")
    assert lines[0] == f"{count} validation errors:"
    assert len(lines) == 1 + min(count, 10) + (count > 10)
    if count > 10:
        assert lines[-1] == f"  ...and {count - 10} more errors"


# Requests at vLLM's limits, accepted (SamplingParams._verify_args and
# _validate_logprobs, the OpenAI requests' own checks).
@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(COMPLETIONS, {"prompt_logprobs": 0}, id="prompt-logprobs-0"),
        pytest.param(COMPLETIONS, {"use_beam_search": True, "n": 10}, id="beam-of-10"),
        pytest.param(COMPLETIONS, {"temperature": 0, "n": 1}, id="greedy-one"),
        pytest.param(
            COMPLETIONS, {"temperature": 1e-5, "n": 2}, id="sampled-at-epsilon"
        ),
        pytest.param(
            CHAT,
            {"logprobs": True, "logprob_token_ids": list(range(128))},
            id="128-logprob-token-ids",
        ),
        pytest.param(
            CHAT,
            {"logprobs": True, "logprob_token_ids": [0, VOCAB_SIZE - 1]},
            id="first-and-last-token-ids-of-the-vocabulary",
        ),
        pytest.param(
            COMPLETIONS,
            {"presence_penalty": 2.0, "frequency_penalty": -2.0},
            id="penalties-at-their-bounds",
        ),
        pytest.param(COMPLETIONS, {"min_p": 0.0}, id="min-p-0"),
        pytest.param(COMPLETIONS, {"min_p": 1.0}, id="min-p-1"),
        pytest.param(COMPLETIONS, {"temperature": 2.0}, id="temperature-2"),
        pytest.param(
            COMPLETIONS,
            {"stream": True, "prompt_logprobs": 0},
            id="stream-prompt-logprobs-0",
        ),
        pytest.param(CHAT, {"top_logprobs": 0}, id="top-logprobs-0-without-logprobs"),
        pytest.param(CHAT, {"stop": ["a", "b", "c", "d"]}, id="four-stop-strings"),
        pytest.param(COMPLETIONS, {"cache_salt": "a" * 128}, id="cache-salt-of-128"),
        pytest.param(COMPLETIONS, {"prompt": ["x"] * 1024}, id="1024-prompts"),
        pytest.param(COMPLETIONS, {"suffix": None}, id="null-suffix"),
        pytest.param(COMPLETIONS, {"prompt_embeds": []}, id="no-prompt-embeds"),
        pytest.param(
            COMPLETIONS,
            {"truncate_prompt_tokens": MAX_MODEL_LEN},
            id="truncation-to-the-context",
        ),
    ],
)
async def test_requests_at_vllms_limits_are_answered(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> None:
    request = (chat_body if path == CHAT else completion_body)(max_tokens=2, **body)
    if request.get("stream"):
        status, events = await stream(session, url + path, request)
        assert (status, events[-1]) == (200, "[DONE]")
        return
    status, answer = await post(session, url + path, request)
    assert status == 200, answer
