"""The base of the fake engine's OpenAI protocol: vLLM's base request model
(unknown fields taken, and logged) and its error answers."""

from __future__ import annotations

import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from engine_patch.log import get_logger

logger = get_logger(__name__)

_T = TypeVar("_T")


class RequestError(ValueError):
    """A request vLLM would refuse: the OpenAI error to answer."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        err_type: str = "BadRequestError",
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.err_type = err_type
        self.status = status


def vllm_validation_error(
    message: str, param: str | None = None, value: Any = None
) -> RequestError:
    """vLLM's ``VLLMValidationError`` as its server answers it: the message
    ends with the parameter and value (``VLLMValidationError.__str__``, which
    ``create_error_response`` sends)."""
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return RequestError(text, param=param)


def error_body(
    message: str,
    err_type: str = "BadRequestError",
    status: HTTPStatus = HTTPStatus.BAD_REQUEST,
    param: str | None = None,
) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``."""
    return {
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": int(status),
        }
    }


_warned_fields: set[str] = set()


class OpenAIBaseModel(BaseModel):
    """Accepts fields it does not know, and warns of them (once per field,
    then at debug level), as vLLM does."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_extra_fields(self) -> OpenAIBaseModel:
        extra = set(self.model_extra or ())
        if extra:
            new = extra - _warned_fields
            _warned_fields.update(new)
            log = logger.warning if new else logger.debug
            log(
                "The following fields were present in the request but ignored: %s",
                sorted(extra),
            )
        return self


# pydantic's schema kinds that show in error locations but name no field
# (vLLM drops the same).
_INTERNAL_LOC_MARKERS = frozenset(
    [
        "function-wrap",
        "function-after",
        "function-before",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "chain",
        "default",
        "nullable",
        "tagged-union",
        "union",
        "call",
        "arguments",
        "is-instance",
        "is-subclass",
        "callable",
        "str",
        "int",
        "float",
        "bool",
        "bytes",
        "bytearray",
        "list",
        "tuple",
        "dict",
        "set",
        "frozenset",
        "complex",
        "none",
        "nonetype",
    ]
)


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """An error location as vLLM's ``param``: ``body.<field path>``."""
    parts = [
        str(p)
        for p in loc
        if not re.search(r"[\[\]{}()]", str(p))
        and str(p).lower() not in _INTERNAL_LOC_MARKERS
    ]
    return ".".join(["body", *parts])


# The type of vLLM's answer to a body FastAPI cannot validate (schema, JSON,
# media type): validation_exception_handler uses the status phrase, where
# vLLM's own errors say "BadRequestError".
VALIDATION_ERROR_TYPE = HTTPStatus.BAD_REQUEST.phrase


# vLLM's bounds on a validation error's text (validation.py).
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def _truncated(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def _summarize(value: Any) -> str:
    """A validation error's ``input`` as vLLM's ``_summarize_error_input``
    gives it: containers described, anything else as text, cut at 200
    characters."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return _truncated(text, _MAX_ERROR_INPUT_CHARS)


def validation_error(exc: ValidationError) -> RequestError:
    """vLLM's answer to a body that fails validation: "N validation
    errors:" and each error, typed "Bad Request"; ``param`` from the first
    error's location. A vLLM error raised while validating is answered as
    it is (vLLM's ``VLLMValidationError`` is no ``ValueError``: pydantic
    lets it through to vLLM's own handler)."""
    errors = exc.errors(include_url=False)
    for error in errors:
        ctx_error = (error.get("ctx") or {}).get("error")
        if isinstance(ctx_error, RequestError):
            return ctx_error
    lines = []
    for error in errors[:10]:
        # FastAPI's error dict (pydantic's, without "url"), as vLLM's
        # _format_error renders it.
        entry: dict[str, Any] = {
            "type": error["type"],
            "loc": _clean_loc(tuple(error["loc"])),
            "msg": error["msg"],
            "input": _summarize(error.get("input")),
        }
        if "ctx" in error:
            entry["ctx"] = error["ctx"]
        lines.append(f"  {_truncated(str(entry), _MAX_ERROR_CHARS)}")
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "\n".join(lines)
    if count > 10:
        message += f"\n  ...and {count - 10} more {label}"
    param = _clean_loc(tuple(errors[0]["loc"])) if errors else None
    return RequestError(message, param=param, err_type=VALIDATION_ERROR_TYPE)


def validate_body(validate: Callable[..., _T], data: Any) -> _T:
    """``data`` validated as FastAPI validates a vLLM request body, by
    ``validate`` (a model's ``model_validate``, an adapter's
    ``validate_python``): with ``from_attributes``, so that a list is "no
    object to extract fields from".

    Raises:
        RequestError: vLLM's answer to a body that fails validation.
    """
    try:
        return validate(data, from_attributes=True)
    except ValidationError as e:
        raise validation_error(e) from None


def json_error(position: int, reason: str) -> RequestError:
    """vLLM's (FastAPI's) answer to a body that is not JSON."""
    entry = {
        "type": "json_invalid",
        "loc": f"body.{position}",
        "msg": "JSON decode error",
        "input": _summarize({}),
        "ctx": {"error": reason},
    }
    return RequestError(
        f"1 validation error:\n  {entry}",
        param=f"body.{position}",
        err_type=VALIDATION_ERROR_TYPE,
    )
