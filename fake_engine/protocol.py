"""vLLM's OpenAI-compatible request and response shapes, as far as the fake
engine serves them: request models (pydantic, validated as vLLM validates
them) and response and stream chunk bodies. The base model and vLLM's error
JSON are in ``openai_base``, the structured-output fields in
``structured_outputs``."""

from __future__ import annotations

import functools
import hashlib
import math
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from engine_patch.log import get_logger
from fake_engine.model import TokenLogprob
from fake_engine.openai_base import (
    OpenAIBaseModel,
    RequestError,
    validate_body,
    vllm_validation_error,
)
from fake_engine.structured_outputs import (
    AnyResponseFormat,
    StructuredOutputs,
    check_response_format,
    check_structured_outputs_count,
    sampling_constraint,
)
from fake_engine.tokenizer import VOCAB_SIZE, decode, encode

logger = get_logger(__name__)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# Temperatures below it sample greedily (vLLM's SamplingParams).
_SAMPLING_EPS = 1e-5
# vLLM's VLLM_MAX_STOP_STRINGS and VLLM_MAX_COMPLETION_PROMPTS, at their
# defaults.
MAX_STOP_STRINGS = 4
MAX_COMPLETION_PROMPTS = 1024
# vLLM's limits on a cache salt (validate_cache_salt).
_MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 16 hex characters (a response's id without
    an ``X-Request-Id``, ``cmpl-`` and these)."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def _out_of_vocabulary(token_ids: Iterable[int]) -> list[int]:
    """The ids of ``token_ids`` outside the vocabulary, in their order."""
    return [t for t in token_ids if t < 0 or t >= VOCAB_SIZE]


def _check_in_vocabulary(name: str, token_ids: Iterable[int]) -> None:
    """vLLM's check that the token ids a request field names are in the
    vocabulary (``SamplingParams``'s ``_validate_logit_bias`` and its
    twins).

    Raises:
        RequestError: vLLM's 400 listing those that are not.
    """
    if invalid := _out_of_vocabulary(token_ids):
        raise vllm_validation_error(
            f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
            f"Vocabulary size: {VOCAB_SIZE}",
            param=name,
            value=invalid,
        )


# --- Requests ---------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _check_stream_options(data: Any) -> Any:
    if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
        raise vllm_validation_error(
            "Stream options can only be defined when `stream=True`.",
            param="stream_options",
        )
    return data


def _check_cache_salt(data: Any) -> Any:
    """vLLM's ``validate_cache_salt``: a salt, where given, is a short
    non-empty string without a separator of the prefix cache's keys."""
    if not isinstance(data, dict) or (salt := data.get("cache_salt")) is None:
        return data
    if not isinstance(salt, str) or not salt:
        raise vllm_validation_error(
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt",
        )
    if len(salt) > _MAX_CACHE_SALT_LENGTH or not _CACHE_SALT_FORBIDDEN_CHARS.isdisjoint(
        salt
    ):
        raise vllm_validation_error(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL.",
            param="cache_salt",
        )
    return data


def _check_logprobs(data: dict[str, Any], count: str) -> None:
    """vLLM's checks of ``prompt_logprobs`` and of the top logprobs asked
    per token (``count``: completions' ``logprobs``, chat's
    ``top_logprobs``) before validation: numbers, not past -1, and no
    prompt logprobs in a stream."""
    for name in ("prompt_logprobs", count):
        value = data.get(name)
        # Before validation: a string would reach the comparisons below.
        if value is not None and not isinstance(value, (int, float)):
            raise vllm_validation_error(
                f"`{name}` must be an integer.", param=name, value=value
            )
    if (prompt_logprobs := data.get("prompt_logprobs")) is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise vllm_validation_error(
                "`prompt_logprobs` are not available when `stream=True`.",
                param="prompt_logprobs",
            )
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise vllm_validation_error(
                "`prompt_logprobs` must be a positive value or -1.",
                param="prompt_logprobs",
                value=prompt_logprobs,
            )
    if (top := data.get(count)) is not None and top < 0 and top != -1:
        raise vllm_validation_error(
            f"`{count}` must be a positive value or -1.", param=count, value=top
        )


def _check_logprob_token_ids_beam(data: dict[str, Any]) -> None:
    """vLLM's first check of ``logprob_token_ids`` (both routes): its
    beam search asks for top logprobs of its own."""
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise vllm_validation_error(
            "`logprob_token_ids` is not supported with beam search.",
            param="logprob_token_ids",
        )


def _check_completion_logprob_token_ids(data: dict[str, Any]) -> None:
    """vLLM's completions checks of ``logprob_token_ids`` after the beam
    search's: there must be output tokens to score, and ``logprobs`` set
    (any value: the requested tokens replace the top ones)."""
    if not data.get("logprob_token_ids"):
        return
    if data.get("echo") and data.get("max_tokens") == 0:
        raise vllm_validation_error(
            "`logprob_token_ids` is not supported when `echo=True` and "
            "`max_tokens=0` because no output tokens are generated.",
            param="logprob_token_ids",
        )
    if data.get("logprobs") is None:
        raise vllm_validation_error(
            "when using `logprob_token_ids`, `logprobs` must be set.",
            param="logprob_token_ids",
        )


def _check_chat_logprob_token_ids(data: dict[str, Any]) -> None:
    """vLLM's chat checks of ``logprob_token_ids``: not with a beam search,
    and only with ``logprobs: true``."""
    _check_logprob_token_ids_beam(data)
    if data.get("logprob_token_ids") and not data.get("logprobs"):
        raise vllm_validation_error(
            "when using `logprob_token_ids`, `logprobs` must be set to true.",
            param="logprob_token_ids",
        )


# vLLM's default --max-logprobs: the most top logprobs a request may ask for.
MAX_LOGPROBS = 20
# vLLM's VLLM_MAX_NUM_BAD_WORDS default: the most bad words, tokenized.
MAX_BAD_WORDS = 128
# vLLM's MAX_LOGPROB_TOKEN_IDS: the most tokens ``logprob_token_ids`` lists.
MAX_LOGPROB_TOKEN_IDS = 128


def _too_many_logprobs(param: str, count: int) -> RequestError:
    """vLLM's refusal of ``count`` logprobs (``logprobs``: per sampled token,
    ``prompt_logprobs``: per prompt token), past ``MAX_LOGPROBS``."""
    kind = "sample" if param == "logprobs" else "prompt"
    return vllm_validation_error(
        f"Requested {kind} logprobs of {count}, which is greater than max "
        f"allowed: {MAX_LOGPROBS}",
        param=param,
        value=count,
    )


class _GenerateRequest(OpenAIBaseModel):
    """Fields completions and chat share. Sampling fields the deterministic
    model does not use (temperature, top_p, seed, ...) are accepted within
    vLLM's ranges (``check_supported``)."""

    model: str | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        default_factory=list
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Tokens a streamed chunk batches (vLLM's per-request stream_interval).
    stream_interval: int | None = Field(None, ge=1)
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    user: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool | None = None
    # Tokens to score at each generated position instead of the top ones.
    # (``prompt_logprob_token_ids`` is no field of vLLM's OpenAI requests:
    # it is ignored as any unknown field is.)
    logprob_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None
    priority: int = 0
    request_id: str = Field(default_factory=random_uuid)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    # The prompt's tokens kept (-1: as many as the context takes), from its
    # end unless ``truncation_side`` is "right".
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Taken and checked as vLLM checks them, not applied (structured_outputs.py).
    response_format: AnyResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    # Whether this is a chat request (vLLM's checks word some errors apart).
    _is_chat: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def _response_format(cls, data: Any) -> Any:
        return check_response_format(data)

    @model_validator(mode="before")
    @classmethod
    def _structured_outputs_count(cls, data: Any) -> Any:
        return check_structured_outputs_count(data, chat=cls._is_chat)

    def check_constraint(self) -> None:
        """vLLM's check of the one output constraint a request's
        ``response_format`` and ``structured_outputs`` make together, as its
        ``to_sampling_params`` builds it (after the prompt is rendered). A
        beam search builds none: vLLM's ``to_beam_search_params`` reads
        neither field.

        Raises:
            RequestError: vLLM's 400 when they make none or several.
        """
        if not self.use_beam_search:
            sampling_constraint(self.structured_outputs, self.response_format)

    @model_validator(mode="before")
    @classmethod
    def _cache_salt(cls, data: Any) -> Any:
        return _check_cache_salt(data)

    def check_supported(self) -> None:
        """vLLM's checks of the values it validates once the body parses, and
        a refusal of what this engine does not support.

        Raises:
            RequestError: For the first value vLLM or this engine refuses.
        """
        if not self.use_beam_search:
            # SamplingParams.from_optional converts its keys before any check.
            _ = self.sampling_logit_bias
        if self.num_choices < 1:
            raise vllm_validation_error(
                f"n must be at least 1, got {self.num_choices}."
            )
        self._check_sampling()
        if self.min_tokens < 0:
            # SamplingParams._verify_args names no parameter here.
            raise vllm_validation_error(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        # As vLLM's input processor checks them (SamplingParams's
        # _validate_logprobs), -1 meaning the vocabulary.
        self._check_logprob_count("logprobs", self.sample_logprobs)
        self._check_logprob_token_ids()
        self._check_logprob_count("prompt_logprobs", self.num_prompt_logprobs)
        if self.use_beam_search:
            # Each step asks for twice the width in logprobs.
            if (count := 2 * self.num_choices) > MAX_LOGPROBS:
                raise _too_many_logprobs("logprobs", count)
            return
        if "" in self.bad_words:
            raise vllm_validation_error(
                "bad_words cannot contain an empty string. "
                f"Got bad_words={list(dict.fromkeys(self.bad_words))}"
            )
        # Checked after the ranges, as SamplingParams does.
        greedy = self.temperature is not None and self.temperature < _SAMPLING_EPS
        if greedy and self.num_choices > 1:
            raise vllm_validation_error(
                f"n must be 1 when using greedy sampling, got {self.num_choices}."
            )
        self._check_sampled_token_ids()
        _ = self.bad_words_token_ids

    def _check_sampled_token_ids(self) -> None:
        """vLLM's checks of the token ids sampling takes (``SamplingParams``'s
        ``verify``, in its order): each in the vocabulary, and
        ``allowed_token_ids`` not empty.

        Raises:
            RequestError: vLLM's 400 for the first check that fails.
        """
        _check_in_vocabulary("logit_bias", self.sampling_logit_bias)
        _check_in_vocabulary("stop_token_ids", self.stop_token_ids or ())
        if (allowed := self.allowed_token_ids) is None:
            return
        if not allowed:
            raise vllm_validation_error(
                "allowed_token_ids is not None and empty!",
                param="allowed_token_ids",
                value=allowed,
            )
        if invalid := _out_of_vocabulary(allowed):
            raise vllm_validation_error(
                "allowed_token_ids contains out-of-vocab token id!",
                param="allowed_token_ids",
                value=invalid,
            )

    @functools.cached_property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` as vLLM's ``update_from_tokenizer`` tokenizes them:
        each word once, stripped on the left. (Its form with a leading space
        is taken too where it encodes to as many tokens, a new first one; on
        this byte-level vocabulary it is always one token longer.)

        Raises:
            RequestError: vLLM's 400 for a word of only spaces, or past
                ``MAX_BAD_WORDS`` words.
        """
        words = list(dict.fromkeys(self.bad_words))
        token_ids = []
        for word in words:
            if not (ids := encode(word.lstrip())):
                raise vllm_validation_error(
                    "bad_words entries must tokenize to at least one token.",
                    param="bad_words",
                    value=words,
                )
            token_ids.append(tuple(ids))
            if len(token_ids) > MAX_BAD_WORDS:
                raise vllm_validation_error(
                    f"Too many bad words after tokenization: {len(token_ids)}. "
                    f"The max number is {MAX_BAD_WORDS}.",
                    param="bad_words",
                    value=words,
                )
        return tuple(token_ids)

    @functools.cached_property
    def sampling_logit_bias(self) -> dict[int, float]:
        """``logit_bias`` as ``SamplingParams.from_optional`` takes it: keys
        converted to token ids, biases clamped to [-100, 100].

        Raises:
            RequestError: vLLM's 400 naming the keys that are no integers.
        """
        bias, invalid = {}, []
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = min(100.0, max(-100.0, value))
            except ValueError:
                invalid.append(key)
        if invalid:
            raise vllm_validation_error(
                "logit_bias contains key(s) that cannot be converted to integer "
                f"token IDs: {invalid!r}",
                param="logit_bias",
                value=invalid,
            )
        return bias

    @staticmethod
    def _check_logprob_count(name: str, count: int | None) -> None:
        """vLLM's limit on the top logprobs asked per token (``name``:
        ``logprobs`` or ``prompt_logprobs``), -1 meaning the vocabulary.

        Raises:
            RequestError: If ``count`` is past ``MAX_LOGPROBS``.
        """
        if count is not None and (count == -1 or count > MAX_LOGPROBS):
            raise _too_many_logprobs(name, VOCAB_SIZE if count == -1 else count)

    def _check_logprob_token_ids(self) -> None:
        """vLLM's checks of ``logprob_token_ids`` in ``SamplingParams``: at
        most ``MAX_LOGPROB_TOKEN_IDS`` of them, each in the vocabulary. (Its
        check that ``logprobs`` equals their count never fires here: the
        OpenAI routes pass no ``logprobs`` with them.)

        Raises:
            RequestError: vLLM's 400 for the first check that fails.
        """
        token_ids = self.requested_logprob_token_ids
        if token_ids is None:
            return
        if (n := len(token_ids)) > MAX_LOGPROB_TOKEN_IDS:
            raise vllm_validation_error(
                f"Requested logprob_token_ids of length {n}, which is greater "
                f"than max allowed: {MAX_LOGPROB_TOKEN_IDS}",
                param="logprob_token_ids",
                value=n,
            )
        _check_in_vocabulary("logprob_token_ids", token_ids)

    @property
    def requested_logprob_token_ids(self) -> tuple[int, ...] | None:
        """The tokens to score at each generated position; None: none (an
        empty list asks for none, as ``logprob_token_ids or None`` in vLLM's
        ``to_sampling_params``)."""
        return tuple(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def num_output_top_logprobs(self) -> int | None:
        """The top logprobs the response lists per generated token (vLLM's
        serving's ``num_output_top_logprobs``); None: no logprobs."""
        raise NotImplementedError

    @property
    def sample_logprobs(self) -> int | None:
        """Top logprobs to compute with each generated token (vLLM's
        ``SamplingParams.logprobs``): None without logprobs, or where
        ``logprob_token_ids`` name the tokens instead."""
        if self.requested_logprob_token_ids is not None:
            return None
        return self.num_output_top_logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs to return with each prompt token; None: no prompt
        logprobs."""
        raise NotImplementedError

    @property
    def num_choices(self) -> int:
        """Choices per prompt (``n``), or beams of a beam search."""
        return 1 if self.n is None else self.n

    def _check_sampling(self) -> None:
        """The ranges vLLM's ``SamplingParams`` enforces on the values a
        request sets, in its order and words: this engine samples greedily,
        but a body vLLM refuses must be refused here too.

        Raises:
            RequestError: vLLM's 400 for the first value out of range.
        """
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise vllm_validation_error(f"{name} must be in [-2, 2], got {value}.")
        if (penalty := self.repetition_penalty) is not None:
            if not math.isfinite(penalty):
                raise vllm_validation_error(
                    f"repetition_penalty must be a finite number, got {penalty}."
                )
            if penalty <= 0.0:
                raise vllm_validation_error(
                    f"repetition_penalty must be greater than zero, got {penalty}."
                )
        if (temperature := self.temperature) is not None:
            if not math.isfinite(temperature):
                reason = "must be a finite number"
            elif temperature < 0.0:
                reason = "must be non-negative"
            elif temperature > 2.0:
                reason = "must be in [0, 2]"
            else:
                reason = ""
            if reason:
                raise vllm_validation_error(
                    f"temperature {reason}, got {temperature}.",
                    param="temperature",
                    value=temperature,
                )
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise vllm_validation_error(
                f"top_p must be in (0, 1], got {self.top_p}.",
                param="top_p",
                value=self.top_p,
            )
        if self.top_k is not None and self.top_k < -1:
            raise vllm_validation_error(
                f"top_k must be 0 (disable), or at least 1, got {self.top_k}."
            )
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise vllm_validation_error(f"min_p must be in [0, 1], got {self.min_p}.")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return bool(
            options and options.include_usage and options.continuous_usage_stats
        )


class CompletionRequest(_GenerateRequest):
    """``POST /v1/completions``."""

    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | None
    ) = None
    echo: bool | None = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: bytes | list[bytes] | None = None

    @property
    def num_output_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        # An echo's text comes with its prompt's logprobs.
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        _check_logprob_token_ids_beam(data)
        if (
            data.get("use_beam_search")
            and data.get("echo")
            and data.get("logprobs") is not None
        ):
            raise vllm_validation_error(
                "`echo` with `logprobs` is not supported with beam search "
                "because beam search does not compute prompt logprobs.",
                param="echo",
            )
        _check_completion_logprob_token_ids(data)
        _check_logprobs(data, "logprobs")
        if data.get("max_tokens") is None:
            data = {**data, "max_tokens": 16}
        prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
        if prompt in (None, "") and embeds in (None, []):
            raise vllm_validation_error(
                "Either prompt or prompt_embeds must be provided and non-empty.",
                param="prompt",
            )
        if (
            isinstance(prompt, list)
            and len(prompt) > MAX_COMPLETION_PROMPTS
            and not all(isinstance(one, int) for one in prompt)
        ):
            raise vllm_validation_error(
                f"prompt list length {len(prompt)} exceeds the maximum allowed "
                f"count of {MAX_COMPLETION_PROMPTS}. To increase this limit, set "
                "the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                param="prompt",
            )
        return data

    def check_renderable(self) -> None:
        """vLLM's refusals as its renderer takes the prompt, in their order:
        a suffix (this model has no fill-in-the-middle rendering) and
        prompt embeddings (a server without ``--enable-prompt-embeds``).

        Raises:
            RequestError: vLLM's 400 for the first.
        """
        if self.suffix is not None:
            if self.echo:
                raise RequestError("Echo is unsupported with suffix.", param="suffix")
            if self.prompt_embeds is not None:
                reason = "suffix is not supported with prompt_embeds"
            elif self.truncate_prompt_tokens is not None:
                reason = "suffix is not supported with truncate_prompt_tokens"
            elif isinstance(self.prompt, str) or (
                isinstance(self.prompt, list)
                and all(isinstance(one, str) for one in self.prompt)
            ):
                reason = (
                    "suffix is only supported for models with FIM completion rendering"
                )
            else:
                reason = (
                    "suffix requires text prompt input for FIM completion rendering"
                )
            raise RequestError(reason, param="suffix")
        if self.prompt_embeds is None:
            return
        if self.echo:
            raise RequestError("Echo is unsupported with prompt embeds.")
        if self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs is not compatible with prompt embeds.")
        if self.prompt_embeds:
            raise vllm_validation_error(
                "You must set `--enable-prompt-embeds` to input `prompt_embeds`.",
                param="prompt_embeds",
            )


# vLLM's ``TopLogprobsParam``: chat's ``top_logprobs``, null read as 0.
TopLogprobsParam = Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)]


class FunctionDefinition(BaseModel):
    """A tool's function, as vLLM's ``FunctionDefinition`` reads it."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(BaseModel):
    """vLLM's ``ChatCompletionToolsParam``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


_TOOL_CHOICE_USAGE = (
    'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
)


def _check_tool_usage(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``check_tool_usage``, in its order and words: tools with no
    ``tool_choice`` mean "auto", and a choice needs tools, a known value or
    one of the tools by name.

    Raises:
        RequestError: vLLM's 400 for the first misuse.
    """
    if data.get("tools") == []:
        raise vllm_validation_error(
            "`tools` must not be an empty array. Either provide at least one "
            "tool or omit the field entirely.",
            param="tools",
        )
    if "tool_choice" not in data and data.get("tools"):
        data = {**data, "tool_choice": "auto"}
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return data
    tools = data.get("tools")
    if tools is None:
        raise vllm_validation_error(
            "When using `tool_choice`, `tools` must be set.", param="tool_choice"
        )
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise vllm_validation_error(
            f"Invalid value for `tool_choice`: {choice}! Only named tools, "
            '"none", "auto" or "required" are supported.',
            param="tool_choice",
        )
    if not isinstance(choice, dict):
        return data
    function = choice.get("function")
    if not isinstance(function, dict):
        raise vllm_validation_error(
            f"Invalid value for `function`: `{function}` in `tool_choice`! "
            f"{_TOOL_CHOICE_USAGE}",
            param="tool_choice.function",
        )
    if "name" not in function:
        raise vllm_validation_error(
            f"Expected field `name` in `function` in `tool_choice`! "
            f"{_TOOL_CHOICE_USAGE}",
            param="tool_choice.function.name",
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise vllm_validation_error(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
            f"{_TOOL_CHOICE_USAGE}",
            param="tool_choice.function.name",
        )
    if not any(
        isinstance(tool, dict)
        and isinstance(tool.get("function"), dict)
        and tool["function"].get("name") == name
        for tool in tools
    ):
        raise vllm_validation_error(
            "The tool specified in `tool_choice` does not match any of the "
            "specified `tools`",
            param="tool_choice",
        )
    return data


def check_generation_prompt(data: Any) -> Any:
    """vLLM's ``check_generation_prompt``: ``continue_final_message`` and
    ``add_generation_prompt`` both set true in the body (the template
    refuses a continuation beside the default generation prompt, in other
    words).

    Raises:
        RequestError: vLLM's 400 when both are.
    """
    if (
        isinstance(data, dict)
        and data.get("continue_final_message")
        and data.get("add_generation_prompt")
    ):
        raise vllm_validation_error(
            "Cannot set both `continue_final_message` and "
            "`add_generation_prompt` to True."
        )
    return data


def check_request_chat_template(
    chat_template: str | None, chat_template_kwargs: dict[str, Any] | None
) -> None:
    """vLLM's refusal of a chat template sent with a request, to a server
    started without ``--trust-request-chat-template``.

    Raises:
        RequestError: vLLM's 400 when the request carries one.
    """
    kwargs = chat_template_kwargs or {}
    if chat_template is not None or kwargs.get("chat_template") is not None:
        raise RequestError(
            "Chat template is passed with request, but "
            "--trust-request-chat-template is not set. Refused request with "
            "untrusted chat template."
        )


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerateRequest):
    """``POST /v1/chat/completions``."""

    _is_chat: ClassVar[bool] = True
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobsParam = 0
    prompt_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[ChatTool] | None = None
    # Checked by _check_tool_usage before the types.
    tool_choice: str | dict[str, Any] | None = "none"
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def num_output_top_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs
        return self.prompt_logprobs

    def check_renderable(self) -> None:
        """vLLM's refusals as its renderer takes the conversation, on a
        server started without tool or chat template options: a tool
        choice (no tool parser) and a chat template in the request.

        Raises:
            RequestError: vLLM's 400 for the first.
        """
        choice = self.tool_choice
        if choice == "auto":
            raise RequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set"
            )
        if choice is not None and choice != "none":
            described = (
                f'function "{choice["function"]["name"]}"'
                if isinstance(choice, dict)
                else f'"{choice}"'
            )
            raise RequestError(
                f"tool_choice={described} requires --tool-call-parser to be set"
            )
        check_request_chat_template(self.chat_template, self.chat_template_kwargs)

    @model_validator(mode="before")
    @classmethod
    def _tool_usage(cls, data: Any) -> Any:
        return _check_tool_usage(data) if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _generation_prompt(cls, data: Any) -> Any:
        return check_generation_prompt(data)

    @model_validator(mode="before")
    @classmethod
    def _logprobs(cls, data: Any) -> Any:
        """vLLM's ``check_logprobs``, in its order and words."""
        if not isinstance(data, dict):
            return data
        _check_chat_logprob_token_ids(data)
        _check_logprobs(data, "top_logprobs")
        top_logprobs = data.get("top_logprobs")
        if (
            top_logprobs is not None
            and (top_logprobs == -1 or top_logprobs > 0)
            and not data.get("logprobs")
        ):
            raise vllm_validation_error(
                "when using `top_logprobs`, `logprobs` must be set to true.",
                param="top_logprobs",
            )
        return data


_Model = TypeVar("_Model", bound=BaseModel)


def parse_request(model: type[_Model], data: Any) -> _Model:
    """Validate a request body as vLLM does.

    Raises:
        RequestError: With vLLM's message and ``param`` for invalid bodies.

    """
    return validate_body(model.model_validate, data)


# --- Responses --------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


# The vLLM release the fake engine answers as.
VLLM_VERSION = "0.32.0"


def system_fingerprint(tp_size: int, config_key: str) -> str:
    """vLLM's default (``--fingerprint-mode full``) ``system_fingerprint``:
    version, TP size beyond 1, and 8 hex digits of a hash of the engine's
    config (``config_key`` here, ``VllmConfig.compute_hash`` in vLLM)."""
    parts = [f"vllm-{VLLM_VERSION}"]
    if tp_size > 1:
        parts.append(f"tp{tp_size}")
    parts.append(hashlib.sha256(config_key.encode()).hexdigest()[:8])
    return "-".join(parts)


def stream_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Usage in a stream's chunks (vLLM drops its None fields there)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


# A token's logprob as vLLM's JSON carries it (-inf would not be JSON).
_MIN_LOGPROB = -9999.0


def _token_text(token_id: int, as_id: bool = False) -> str:
    """A token as vLLM's logprobs name it: its decoded text, or with
    ``as_id`` (``return_tokens_as_token_ids``) its id."""
    if as_id:
        return f"token_id:{token_id}"
    return decode([token_id], skip_special_tokens=False)


def _own(token_id: int, entries: list[TokenLogprob]) -> TokenLogprob:
    """``token_id``'s entry among a position's logprobs: the first, unless a
    beam chose another of them."""
    return next((e for e in entries if e.token_id == token_id), entries[0])


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[list[TokenLogprob] | None],
    text_offset: int = 0,
    as_ids: bool = False,
    top: int | None = None,
) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs`` of ``token_ids`` (a prompt's first has
    none), offsets counted from ``text_offset``; tokens named by id with
    ``as_ids``; with ``top``, at most ``top`` + 1 of each position's
    likeliest tokens listed, as vLLM lists them."""
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    offset = text_offset
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        token = _token_text(token_id, as_ids)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        if entries is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(max(_own(token_id, entries).logprob, _MIN_LOGPROB))
        listed = entries if top is None else entries[: top + 1]
        tops.append(
            {
                _token_text(e.token_id, as_ids): max(e.logprob, _MIN_LOGPROB)
                for e in listed
            }
        )
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[list[TokenLogprob]],
    top: int | None,
    as_ids: bool = False,
) -> dict[str, Any]:
    """vLLM's ``ChatCompletionLogProbs`` of ``token_ids``, ``top`` of each
    one's likeliest tokens listed (None: all its entries, vLLM's
    ``return_all``); tokens named by id with ``as_ids``."""
    content = []
    for token_id, entries in zip(token_ids, logprobs, strict=True):
        token = _token_text(token_id, as_ids)
        content.append(
            {
                "token": token,
                "logprob": max(_own(token_id, entries).logprob, _MIN_LOGPROB),
                "bytes": list(token.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": (text := _token_text(e.token_id, as_ids)),
                        "logprob": max(e.logprob, _MIN_LOGPROB),
                        "bytes": list(text.encode("utf-8", errors="replace")),
                    }
                    for e in (entries if top is None else entries[:top])
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_json(
    logprobs: list[list[TokenLogprob] | None],
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), its
    logprob, rank and text, then the likeliest others', by token id."""
    return [
        None
        if entries is None
        else {
            str(e.token_id): {
                "logprob": max(e.logprob, _MIN_LOGPROB),
                "rank": e.rank,
                "decoded_token": _token_text(e.token_id),
            }
            for e in entries
        }
        for entries in logprobs
    ]


@dataclass(frozen=True)
class ResponseBuilder:
    """Every body of one request's answer as vLLM's ``/v1/completions``
    (``chat=False``) or ``/v1/chat/completions`` (``chat=True``) writes it:
    the whole response, or a stream's chunks. vLLM's schema lives here only.

    ``echo`` (completions) is the prompt's text, put before the answer's
    (empty with ``return_token_ids``, as vLLM's); with ``echoes`` a stream's
    first chunk carries the prompt's ids, asked for or not, as vLLM's does.
    ``continuous_usage`` puts usage in every chunk, ``include_usage`` a usage
    chunk at the end (``stream_options``). ``system_fingerprint`` goes in
    the whole response and in a stream's last chunk.
    """

    chat: bool
    response_id: str
    model: str
    prompt_token_ids: list[int]
    return_token_ids: bool = False
    continuous_usage: bool = False
    include_usage: bool = False
    echo: str = ""
    echoes: bool = False
    # An echo without generation (``max_tokens`` 0): the text and logprobs
    # are the prompt's alone. The one token vLLM samples for it, and drops,
    # still counts in usage and shows in ``token_ids``.
    echo_only: bool = False
    system_fingerprint: str | None = None
    # The choice's index: its prompt's times n, plus its own among the n.
    index: int = 0
    # Logprobs asked for: top ones per generated token (None: none), and
    # the prompt's (``FakeModel.prompt_logprobs``), for an echo's tokens and
    # the ``prompt_logprobs`` field.
    logprobs: int | None = None
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    # ``logprob_token_ids`` were asked: every entry of a position is listed,
    # whatever ``logprobs`` (vLLM's ``return_all``).
    return_all_logprobs: bool = False
    # Logprobs name tokens by id (``return_tokens_as_token_ids``).
    tokens_as_ids: bool = False
    # A stream's chunks all carry the time it started.
    created: int = field(default_factory=now)

    @property
    def _object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str, created: int) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj,
            "created": created,
            "model": self.model,
        }

    def _stream_usage(self, num_output: int) -> dict[str, Any] | None:
        if not self.continuous_usage:
            return None
        chunk_usage = stream_usage(len(self.prompt_token_ids), num_output)
        if self.chat:
            # vLLM's chat stream sets it (None without reasoning tokens).
            chunk_usage["completion_tokens_details"] = None
        return chunk_usage

    def response(
        self,
        *,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        token_ids: list[int],
        kv_transfer_params: dict[str, Any] | None,
        logprobs: list[list[TokenLogprob]] | None = None,
    ) -> dict[str, Any]:
        """The whole (non-streamed) response, created now; ``logprobs`` per
        token of ``token_ids`` where asked for."""
        ids = self.return_token_ids
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
        else:
            choice["text"] = self.echo + ("" if self.echo_only else text)
        choice["logprobs"] = self._logprobs(token_ids, logprobs, echo=True)
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = stop_reason
        choice["token_ids"] = token_ids if ids else None
        prompt_logprobs = (
            None
            if self.prompt_logprobs is None
            else prompt_logprobs_json(self.prompt_logprobs)
        )
        if not self.chat:
            choice["prompt_logprobs"] = prompt_logprobs
            choice["prompt_token_ids"] = self.prompt_token_ids if ids else None
        choice["routed_experts"] = None
        body = self._head(self._object, now())
        body["choices"] = [choice]
        body["service_tier"] = None
        body["system_fingerprint"] = self.system_fingerprint
        body["usage"] = usage(len(self.prompt_token_ids), len(token_ids))
        if self.chat:
            body["prompt_logprobs"] = prompt_logprobs
            body["prompt_token_ids"] = self.prompt_token_ids if ids else None
            body["prompt_text"] = None
        body["kv_transfer_params"] = kv_transfer_params
        body["ec_transfer_params"] = None
        body["metrics"] = None
        return body

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[list[TokenLogprob]] | None,
        *,
        echo: bool,
        text_offset: int = 0,
    ) -> dict[str, Any] | None:
        """A choice's ``logprobs`` of ``token_ids`` (after the prompt's, for a
        completions echo, with ``echo``), None where not asked for."""
        if self.logprobs is None or logprobs is None:
            return None
        as_ids = self.tokens_as_ids
        top = None if self.return_all_logprobs else self.logprobs
        if self.chat:
            return chat_logprobs(token_ids, logprobs, top, as_ids)
        if echo and self.echoes and self.prompt_logprobs is not None:
            if self.echo_only:
                token_ids, logprobs = [], []
            return completion_logprobs(
                [*self.prompt_token_ids, *token_ids],
                [*self.prompt_logprobs, *logprobs],
                text_offset,
                as_ids,
                top,
            )
        return completion_logprobs(token_ids, list(logprobs), text_offset, as_ids, top)

    def role_chunk(self) -> dict[str, Any] | None:
        """A chat stream's first chunk, naming the role; None for completions."""
        if not self.chat:
            return None
        chunk = self._head(self._chunk_object, self.created)
        chunk["choices"] = [
            {
                "index": self.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if (chunk_usage := self._stream_usage(0)) is not None:
            chunk["usage"] = chunk_usage
        chunk["prompt_token_ids"] = (
            self.prompt_token_ids if self.return_token_ids else None
        )
        chunk["prompt_text"] = None
        return chunk

    def chunk(
        self,
        *,
        text: str,
        finish_reason: str | None,
        stop_reason: int | str | None,
        token_ids: list[int],
        first: bool,
        num_output: int,
        logprobs: list[list[TokenLogprob]] | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """A stream's chunk of new text (``first``: the stream's first),
        ``num_output`` tokens generated so far; ``logprobs`` per token of
        ``token_ids``, a completion's text offsets from ``text_offset``."""
        ids = self.return_token_ids
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = (self.echo if first else "") + (
                "" if self.echo_only else text
            )
        choice["logprobs"] = self._logprobs(
            token_ids, logprobs, echo=first, text_offset=text_offset
        )
        choice["finish_reason"] = finish_reason
        if self.chat:
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
        else:
            choice["stop_reason"] = stop_reason
            choice["prompt_token_ids"] = (
                self.prompt_token_ids if first and (ids or self.echoes) else None
            )
        choice["token_ids"] = token_ids if ids else None
        chunk = self._head(self._chunk_object, self.created)
        chunk["choices"] = [choice]
        if (chunk_usage := self._stream_usage(num_output)) is not None:
            chunk["usage"] = chunk_usage
        last = finish_reason is not None and not self.include_usage
        if last and self.system_fingerprint is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        return chunk

    def usage_chunk(self, num_prompt: int, num_output: int) -> dict[str, Any] | None:
        """A stream's closing usage chunk, if ``include_usage``: ``num_prompt``
        tokens of all its prompts (each once, whatever n), ``num_output`` of
        all its choices."""
        if not self.include_usage:
            return None
        chunk = self._head(self._chunk_object, self.created)
        chunk["choices"] = []
        chunk["usage"] = stream_usage(num_prompt, num_output)
        if self.system_fingerprint is not None:
            chunk["system_fingerprint"] = self.system_fingerprint
        return chunk


def models_response(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{random_uuid()}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
