"""``response_format`` and ``structured_outputs`` as vLLM 0.32 checks them
(``entrypoints/openai/*/protocol.py``, ``sampling_params.StructuredOutputsParams``):
what it refuses before compiling a grammar is refused in its words; what it
takes is answered, unconstrained (the fake model has no grammar)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from fake_engine_helpers import CHAT, COMPLETIONS, chat_body, completion_body, post

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# vLLM's StructuredOutputsParams.__dict__, as its errors show it.
NO_CONSTRAINT = (
    "{'json': None, 'regex': None, 'choice': None, 'grammar': None, "
    "'json_object': None, 'disable_any_whitespace': False, "
    "'disable_additional_properties': False, 'whitespace_pattern': None, "
    "'structural_tag': None, '_backend': None, '_backend_was_auto': False}"
)
TWO_CONSTRAINTS = (
    "You can only use one kind of constraints for structured outputs "
    "('json', 'regex' or 'choice')."
)
NONE_SPECIFIED = (
    "You must use one kind of structured outputs constraint but none are "
    f"specified: {NO_CONSTRAINT}"
)


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    return (chat_body if path == CHAT else completion_body)(**fields)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        pytest.param(CHAT, {"response_format": {"type": "text"}}, id="text"),
        pytest.param(CHAT, {"response_format": {"type": "json_object"}}, id="json"),
        pytest.param(
            COMPLETIONS, {"response_format": {"type": "json_object"}}, id="json-c"
        ),
        pytest.param(
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            id="json-schema",
        ),
        pytest.param(
            CHAT, {"structured_outputs": {"choice": ["yes", "no"]}}, id="choice"
        ),
        pytest.param(COMPLETIONS, {"structured_outputs": {"regex": "[a-z]+"}}, id="re"),
        pytest.param(COMPLETIONS, {"structured_outputs": {"json": SCHEMA}}, id="js"),
        pytest.param(
            CHAT,
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "text"}},
            id="text-over-a-regex",
        ),
    ],
)
async def test_a_constraint_vllm_takes_is_answered(
    session: aiohttp.ClientSession, url: str, path: str, fields: dict[str, Any]
) -> None:
    status, answer = await post(session, url + path, body_for(path, **fields))
    assert status == 200, answer


REFUSALS = [
    pytest.param(
        CHAT,
        {"response_format": {"type": "json_schema"}},
        "BadRequestError",
        "response_format",
        "When response_format type is 'json_schema', the 'json_schema' field must "
        "be provided. (parameter=response_format)",
        id="json-schema-without-its-object",
    ),
    pytest.param(
        CHAT,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "BadRequestError",
        None,
        NONE_SPECIFIED,
        id="json-schema-without-a-schema",
    ),
    pytest.param(
        CHAT,
        {"response_format": "json"},
        "Bad Request",
        "body.response_format",
        "3 validation errors:\n"
        + "\n".join(
            [
                "  {'type': 'model_attributes_type', 'loc': 'body.response_format', "
                "'msg': 'Input should be a valid dictionary or object to extract "
                "fields from', 'input': 'json'}"
            ]
            * 3
        ),
        id="format-not-an-object",
    ),
    pytest.param(
        COMPLETIONS,
        {"response_format": {"type": "yaml"}},
        "Bad Request",
        "body.response_format.type",
        "6 validation errors:\n"
        "  {'type': 'literal_error', 'loc': 'body.response_format.type', 'msg': "
        "\"Input should be 'text', 'json_object' or 'json_schema'\", 'input': "
        "'yaml', 'ctx': {'expected': \"'text', 'json_object' or 'json_schema'\"}}\n"
        "  {'type': 'literal_error', 'loc': 'body.response_format.type', 'msg': "
        "\"Input should be 'structural_tag'\", 'input': 'yaml', 'ctx': "
        "{'expected': \"'structural_tag'\"}}\n"
        "  {'type': 'missing', 'loc': 'body.response_format.format', 'msg': "
        "'Field required', 'input': '<dict of 1 items>'}\n"
        "  {'type': 'literal_error', 'loc': 'body.response_format.type', 'msg': "
        "\"Input should be 'structural_tag'\", 'input': 'yaml', 'ctx': "
        "{'expected': \"'structural_tag'\"}}\n"
        "  {'type': 'missing', 'loc': 'body.response_format.structures', 'msg': "
        "'Field required', 'input': '<dict of 1 items>'}\n"
        "  {'type': 'missing', 'loc': 'body.response_format.triggers', 'msg': "
        "'Field required', 'input': '<dict of 1 items>'}",
        id="unknown-format-type",
    ),
    pytest.param(
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "BadRequestError",
        "structured_outputs",
        f"{TWO_CONSTRAINTS} (parameter=structured_outputs)",
        id="two-constraints",
    ),
    pytest.param(
        CHAT,
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "BadRequestError",
        None,
        TWO_CONSTRAINTS,
        id="two-constraints-chat",
    ),
    pytest.param(
        COMPLETIONS,
        {"structured_outputs": {"regex": "a", "grammar": "root ::= 'a'"}},
        "BadRequestError",
        None,
        "You can only use one kind of structured outputs constraint but multiple "
        "are specified: {'json': None, 'regex': 'a', 'choice': None, 'grammar': "
        "\"root ::= 'a'\", 'json_object': None, 'disable_any_whitespace': False, "
        "'disable_additional_properties': False, 'whitespace_pattern': None, "
        "'structural_tag': None, '_backend': None, '_backend_was_auto': False}",
        id="a-regex-and-a-grammar",
    ),
    pytest.param(
        COMPLETIONS,
        {"structured_outputs": {"disable_any_whitespace": True, "nope": 1}},
        "BadRequestError",
        None,
        NONE_SPECIFIED.replace(
            "'disable_any_whitespace': False", "'disable_any_whitespace': True"
        ),
        id="no-constraint",
    ),
    pytest.param(
        CHAT,
        {
            "structured_outputs": {"regex": "a"},
            "response_format": {"type": "json_object"},
        },
        "BadRequestError",
        None,
        "You can only use one kind of structured outputs constraint but multiple "
        "are specified: {'json': None, 'regex': 'a', 'choice': None, 'grammar': "
        "None, 'json_object': True, 'disable_any_whitespace': False, "
        "'disable_additional_properties': False, 'whitespace_pattern': None, "
        "'structural_tag': None, '_backend': None, '_backend_was_auto': False}",
        id="a-regex-and-json-mode",
    ),
    pytest.param(
        COMPLETIONS,
        {"structured_outputs": {"choice": "yes"}},
        "Bad Request",
        "body.structured_outputs.choice",
        "1 validation error:\n  {'type': 'list_type', 'loc': "
        "'body.structured_outputs.choice', 'msg': 'Input should be a valid list', "
        "'input': 'yes'}",
        id="choice-not-a-list",
    ),
]


@pytest.mark.parametrize(("path", "fields", "err_type", "param", "message"), REFUSALS)
async def test_a_constraint_vllm_refuses_is_refused_in_its_words(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    fields: dict[str, Any],
    err_type: str,
    param: str | None,
    message: str,
) -> None:
    status, answer = await post(session, url + path, body_for(path, **fields))
    assert (status, answer) == (
        400,
        {"error": {"message": message, "type": err_type, "param": param, "code": 400}},
    )


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("value", "kind"), [([], "list"), ("json", "str"), (1, "int"), (True, "bool")]
)
async def test_structured_outputs_that_are_no_object_fail_as_vllm_fails_them(
    session: aiohttp.ClientSession, url: str, path: str, value: Any, kind: str
) -> None:
    # vLLM's check_structured_outputs_count calls .get on the value before
    # pydantic checks its type: an internal error, 500.
    status, answer = await post(
        session, url + path, body_for(path, structured_outputs=value)
    )
    assert (status, answer) == (
        500,
        {
            "error": {
                "message": f"'{kind}' object has no attribute 'get'",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        },
    )


async def test_a_constraint_beside_a_named_tool_is_refused_in_chat(
    session: aiohttp.ClientSession, url: str
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    fields = {
        "structured_outputs": {"regex": "a"},
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    status, answer = await post(session, url + CHAT, chat_body(**fields))
    assert status == 400
    assert answer["error"]["message"] == (
        "You can only either use constraints for structured outputs or tools, not both."
    )


async def test_a_beam_search_builds_no_constraint(
    session: aiohttp.ClientSession, url: str
) -> None:
    # vLLM's beam search takes to_beam_search_params, which reads neither.
    fields = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        "use_beam_search": True,
        "n": 2,
    }
    status, answer = await post(session, url + COMPLETIONS, completion_body(**fields))
    assert status == 200, answer
