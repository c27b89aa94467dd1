"""The base of the fake engine's OpenAI protocol: vLLM's base request model
(unknown fields taken, and logged) and its error answers."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from engine_patch.log import get_logger

logger = get_logger(__name__)


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
