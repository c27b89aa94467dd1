"""vLLM's ``/tokenize`` and ``/detokenize`` bodies and answers, over the fake
model's tokenizer (vLLM's ``entrypoints/serve/tokenize``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, model_validator

from fake_engine.openai_base import OpenAIBaseModel, validate_body
from fake_engine.protocol import ChatMessage, ChatTool, check_generation_prompt
from fake_engine.tokenizer import VOCAB_SIZE, decode


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a prompt."""

    model: str | None = None
    prompt: str
    # The fake tokenizer has no special tokens to add.
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a conversation, rendered as a chat request's."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Rendered without: the fake template, as the tiny model's, has no tools.
    tools: list[ChatTool] | None = None

    @model_validator(mode="before")
    @classmethod
    def _generation_prompt(cls, data: Any) -> Any:
        return check_generation_prompt(data)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest

# pydantic's smart union, as FastAPI validates vLLM's: a body with both a
# prompt and messages is the member that sets more fields, its messages'
# own included.
_tokenize_request = TypeAdapter[TokenizeRequest](TokenizeRequest)


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


def parse_tokenize_request(data: Any) -> TokenizeRequest:
    """A ``/tokenize`` body as vLLM reads it.

    Raises:
        RequestError: vLLM's 400, each member's errors listed, for a body
            neither member takes.
    """
    return validate_body(_tokenize_request.validate_python, data)


def tokenize_response(
    token_ids: list[int], max_model_len: int, return_token_strs: bool | None
) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``: the ids, their count, the context length
    and, when asked, each token's text."""
    token_strs = (
        [decode([t], skip_special_tokens=False) for t in token_ids]
        if return_token_strs
        else None
    )
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }


def detokenize_response(token_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``DetokenizeResponse``: the text of ``token_ids``, special
    tokens shown, ids outside the vocabulary left out (as the tokenizer
    leaves out ids it has no token for)."""
    known = [t for t in token_ids if t < VOCAB_SIZE]
    return {"prompt": decode(known, skip_special_tokens=False)}
