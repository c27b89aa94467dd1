"""vLLM's structured-output fields (``response_format``,
``structured_outputs``) as its OpenAI server validates them.

The fake model cannot constrain its output to a grammar: a request whose
constraints vLLM takes is answered unconstrained. What vLLM refuses before
compiling a grammar is refused here in its words; what only its grammar
backend (xgrammar) refuses, a schema it cannot compile, a malformed regex
or grammar or structural tag, is taken.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from http import HTTPStatus
from typing import Any, Literal, TypeAlias

from pydantic import Field, ValidationError
from pydantic.dataclasses import dataclass

from fake_engine.openai_base import (
    OpenAIBaseModel,
    RequestError,
    validation_error,
    vllm_validation_error,
)


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuralTagResponseFormat(OpenAIBaseModel):
    type: Literal["structural_tag"]
    format: Any


class LegacyStructuralTag(OpenAIBaseModel):
    begin: str
    structural_tag_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class LegacyStructuralTagResponseFormat(OpenAIBaseModel):
    type: Literal["structural_tag"]
    structures: list[LegacyStructuralTag]
    triggers: list[str]


# In vLLM's order: a body none of them takes lists each one's errors.
AnyResponseFormat: TypeAlias = (
    ResponseFormat | StructuralTagResponseFormat | LegacyStructuralTagResponseFormat
)

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputs:
    """vLLM's ``StructuredOutputsParams`` (a pydantic dataclass: unknown keys
    dropped): exactly one constraint.

    Raises:
        RequestError: vLLM's 400 for none or several, showing the fields.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # Set by vLLM's input processor; shown in its errors.
    _backend: str | None = field(default=None, init=False)
    _backend_was_auto: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in _CONSTRAINTS)
        if count > 1:
            raise RequestError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if count < 1:
            raise RequestError(
                "You must use one kind of structured outputs constraint "
                f"but none are specified: {self.__dict__}"
            )


def check_response_format(data: Any) -> Any:
    """vLLM's ``validate_response_format`` (before the types): a JSON-schema
    format must carry its schema object.

    Raises:
        RequestError: vLLM's 400 naming ``response_format``.
    """
    if not isinstance(data, dict):
        return data
    response_format = data.get("response_format")
    if (
        isinstance(response_format, dict)
        and response_format.get("type") == "json_schema"
        and response_format.get("json_schema") is None
    ):
        raise vllm_validation_error(
            "When response_format type is 'json_schema', the 'json_schema' "
            "field must be provided.",
            param="response_format",
        )
    return data


def check_structured_outputs_count(data: Any, *, chat: bool) -> Any:
    """vLLM's ``check_structured_outputs_count`` (before the types), as each
    route words it: one of ``json``, ``regex`` and ``choice`` at most, and
    (chat) no constraint beside a named tool choice.

    Raises:
        RequestError: vLLM's 400; its 500 for ``structured_outputs`` that
            is no object (vLLM calls ``.get`` on it before its type is
            checked).
    """
    if not isinstance(data, dict):
        return data
    kwargs = data.get("structured_outputs")
    if kwargs is None:
        return data
    if not isinstance(kwargs, dict):
        raise RequestError(
            f"'{type(kwargs).__name__}' object has no attribute 'get'",
            err_type="InternalServerError",
            status=HTTPStatus.INTERNAL_SERVER_ERROR,
        )
    count = sum(kwargs.get(name) is not None for name in ("json", "regex", "choice"))
    if count > 1:
        message = (
            "You can only use one kind of constraints for structured outputs "
            "('json', 'regex' or 'choice')."
        )
        if chat:
            raise vllm_validation_error(message)
        raise vllm_validation_error(message, param="structured_outputs")
    if (
        chat
        and count > 0
        and data.get("tool_choice", "none") not in ("none", "auto", "required")
    ):
        raise vllm_validation_error(
            "You can only either use constraints for structured outputs or "
            "tools, not both."
        )
    return data


def sampling_constraint(
    structured_outputs: StructuredOutputs | None,
    response_format: AnyResponseFormat | None,
) -> StructuredOutputs | None:
    """The constraint vLLM's ``to_sampling_params`` builds: ``response_format``
    applied over ``structured_outputs`` (``structured_outputs_from_response_format``).

    Raises:
        RequestError: vLLM's 400 when that leaves none or several.
    """
    if response_format is None or response_format.type == "text":
        return structured_outputs
    overrides: dict[str, Any]
    if isinstance(response_format, ResponseFormat):
        if response_format.type == "json_object":
            overrides = {"json_object": True}
        else:
            assert response_format.json_schema is not None
            overrides = {"json": response_format.json_schema.json_schema}
    else:
        overrides = {
            "structural_tag": json.dumps(response_format.model_dump(by_alias=True))
        }
    try:
        if structured_outputs is None:
            return StructuredOutputs(**overrides)
        return dataclasses.replace(structured_outputs, **overrides)
    except ValidationError as e:
        raise validation_error(e) from None
