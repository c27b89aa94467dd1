"""Client request bodies: the checks the flow needs, and the two legs' bodies.

The decode leg gets the client's bytes verbatim with the prefill's
``kv_transfer_params`` spliced in byte for byte; the prefill leg is the parsed
body with only the fields docs/wire.md names changed, so no field is ever added
that the client did not send (beyond ``kv_transfer_params`` and the token caps).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgspec
import pydantic

_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode

KV_PARAMS = "kv_transfer_params"
_TOO_DEEP = "Request body is nested too deeply"

# vLLM reads a body into pydantic models in lax mode, where a ``bool | None``
# field also takes "true", "yes", "on", "1", 1, 1.0 and their false twins.
_lax_bool_or_none = pydantic.TypeAdapter(bool | None).validate_python
_lax_int_or_none = pydantic.TypeAdapter(int | None).validate_python
_lax_int = pydantic.TypeAdapter(int).validate_python


def _vllm_bool(value: Any) -> bool | None:
    """``value`` as vLLM's pydantic reads a ``bool | None`` field.

    A JSON bool or null is returned as pydantic would return it, without
    its call: most bodies hold only those, and the flow reads several.

    Raises:
        pydantic.ValidationError: a value vLLM refuses too.
    """
    if value is None or value is True or value is False:
        return value
    return _lax_bool_or_none(value)


def _vllm_int(value: Any) -> int | None:
    """``value`` as vLLM's pydantic reads an ``int | None`` field (a JSON
    integer or null as is; a bool, which pydantic turns into 1 or 0, is not
    one here).

    Raises:
        pydantic.ValidationError: a value vLLM refuses too.
    """
    if value is None or type(value) is int:
        return value
    return _lax_int_or_none(value)


def _vllm_count(value: Any) -> int:
    """``value`` as vLLM's pydantic reads an ``int`` field.

    Raises:
        pydantic.ValidationError: a value vLLM refuses too (null included).
    """
    if type(value) is int:
        return value
    return _lax_int(value)


class _StreamOptions(pydantic.BaseModel):
    """vLLM's ``StreamOptions``, read only to refuse what vLLM refuses."""

    model_config = pydantic.ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_vllm_stream_options = pydantic.TypeAdapter(_StreamOptions | None).validate_python
# vLLM's CompletionRequest.max_tokens when absent or null.
_COMPLETIONS_MAX_TOKENS = 16

# What the proxy asks of the prefill (docs/wire.md, "Proxy → prefill").
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Route(enum.Enum):
    """The OpenAI endpoints the proxy disaggregates."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def label(self) -> str:
        return "completions" if self is Route.COMPLETIONS else "chat"


class BadRequest(Exception):
    """A body the proxy cannot route; becomes a 400 in OpenAI error JSON."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True)
class ClientRequest:
    """A checked client body.

    ``raw`` is what the decode receives when the prefill returns no
    ``kv_transfer_params``: the client's bytes, re-encoded only when the
    client's own ``kv_transfer_params`` had to be dropped.
    """

    raw: bytes
    obj: dict[str, Any]
    model: str | None
    stream: bool
    dropped_kv_params: bool


def parse_request(raw: bytes, route: Route) -> ClientRequest:
    """Checks a client body for what the flow needs.

    Raises:
        BadRequest: not a JSON object, a field the flow reads has the
            wrong type or is missing, or ``structured_outputs`` is no object.
    """
    try:
        obj = _decode_json(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    if not isinstance(obj, dict):
        raise BadRequest("Request body must be a JSON object")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model")
    stream = _flag(obj, "stream")
    if route is Route.COMPLETIONS:
        prompt = obj.get("prompt")
        embeds = obj.get("prompt_embeds")
        if (not isinstance(prompt, (str, list)) or not prompt) and (
            not isinstance(embeds, (str, list)) or not embeds
        ):
            raise BadRequest(
                "'prompt' is required (a string or a list), or 'prompt_embeds'",
                "prompt",
            )
    else:
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required: a non-empty list", "messages")
    constraints = obj.get("structured_outputs")
    if constraints is not None and not isinstance(constraints, dict):
        # vLLM 0.32 answers these with a 500 (its validator calls .get on
        # them), after which the proxy would try another prefill.
        raise BadRequest("'structured_outputs' must be an object", "structured_outputs")
    # A client must never aim a decode at a host of its choosing. vLLM takes
    # the params from vllm_xargs too when the body has none of its own.
    dropped = KV_PARAMS in obj
    obj.pop(KV_PARAMS, None)
    xargs = obj.get("vllm_xargs")
    if isinstance(xargs, dict) and KV_PARAMS in xargs:
        del xargs[KV_PARAMS]
        dropped = True
    if dropped:
        raw = _encode(obj)
    return ClientRequest(raw, obj, model, stream, dropped)


def _flag(obj: dict[str, Any], name: str) -> bool:
    """``obj[name]`` as vLLM reads a ``bool | None`` field; absent or null is False.

    Raises:
        BadRequest: a value vLLM refuses too.
    """
    value = obj.get(name)
    if isinstance(value, bool):
        return value
    try:
        return bool(_vllm_bool(value))
    except pydantic.ValidationError:
        raise BadRequest(f"'{name}' must be a boolean", name) from None


def _encode(obj: Any) -> bytes:
    """A checked body as JSON.

    Raises:
        BadRequest: nested too deeply to encode (decoding it may just have
            fitted within the interpreter's recursion limit).
    """
    try:
        return _encode_json(obj)
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None


def prefill_body(req: ClientRequest) -> bytes:
    """The prefill leg's body: one token, no stream, ask for remote decode.

    Raises:
        BadRequest: the body is nested too deeply to encode.
    """
    obj = dict(req.obj)
    obj["stream"] = False
    obj["max_tokens"] = 1
    if "max_completion_tokens" in obj:
        obj["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        obj.pop(name, None)
    obj[KV_PARAMS] = PREFILL_KV_PARAMS
    return _encode(obj)


@dataclass(frozen=True, slots=True)
class OutputBudget:
    """The output tokens a request asks for, as vLLM reads them."""

    param: str
    """The field vLLM names when it refuses the budget."""
    tokens: int | None
    """None: up to the model's context length."""


def check_decode_fields(req: ClientRequest, route: Route) -> OutputBudget:
    """Refuses, as vLLM does, the fields only the decode leg reads, and
    returns the request's output budget.

    The prefill leg asks for one token and no stream (:func:`prefill_body`),
    so vLLM would refuse a bad ``max_tokens``, ``min_tokens`` or
    ``stream_options`` only on the decode, after the prefill ran and left KV
    that nobody pulls (docs/wire.md, "Fields only the decode reads").
    Checks that depend on the prompt's length are left to the decode.

    Raises:
        BadRequest: a value vLLM refuses whatever the prompt.
    """
    obj = req.obj
    options = obj.get("stream_options")
    # vLLM checks the raw values before parsing them.
    if options and not obj.get("stream"):
        raise BadRequest(
            "Stream options can only be defined when `stream=True`.",
            "stream_options",
        )
    try:
        _vllm_stream_options(options)
    except pydantic.ValidationError:
        raise BadRequest(
            "'stream_options' must be an object of booleans", "stream_options"
        ) from None
    max_tokens = _count(obj, "max_tokens")
    if route is Route.CHAT:
        completion_tokens = _count(obj, "max_completion_tokens")
        if completion_tokens is not None:
            budget = OutputBudget("max_completion_tokens", completion_tokens)
        else:
            budget = OutputBudget("max_tokens", max_tokens)
    else:
        tokens = _COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens
        budget = OutputBudget("max_tokens", tokens)
    min_tokens = _count(obj, "min_tokens", default=0)
    assert min_tokens is not None
    sampled = budget.tokens
    if sampled == 0 and route is Route.COMPLETIONS and _lax_bool(obj.get("echo")):
        sampled = 1  # vLLM echoes the prompt and samples one token
    if sampled is not None and sampled < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {sampled}.", "max_tokens")
    if min_tokens < 0:
        raise BadRequest(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
            "min_tokens",
        )
    if sampled is not None and min_tokens > sampled:
        raise BadRequest(
            "min_tokens must be less than or equal to "
            f"max_tokens={sampled}, got {min_tokens}.",
            "min_tokens",
        )
    return budget


def _count(obj: dict[str, Any], name: str, default: int | None = None) -> int | None:
    """``obj[name]`` as vLLM reads an integer field: ``int | None`` when
    ``default`` is None, else ``int`` with that default when absent.

    Raises:
        BadRequest: a value vLLM refuses too.
    """
    if name not in obj:
        return default
    value = obj[name]
    try:
        return _vllm_int(value) if default is None else _vllm_count(value)
    except pydantic.ValidationError:
        raise BadRequest(f"'{name}' must be an integer", name) from None


def _lax_bool(value: Any) -> bool:
    """``value`` as vLLM reads a ``bool`` field; one vLLM refuses counts as
    False (the prefill, which gets it too, answers that 400)."""
    try:
        return bool(_vllm_bool(value))
    except pydantic.ValidationError:
        return False


def computed_alone(req: ClientRequest, route: Route) -> bool:
    """Whether vLLM reads no KV it did not compute for the request, and
    answers it otherwise in a stream: prompt logprobs
    (``wants_prompt_logprobs``; in its non-streaming reply only) or a beam
    search (``uses_beam_search``; refused in a completions stream). Its
    decode prefills it locally, and is not streamed for a non-streaming
    client."""
    return wants_prompt_logprobs(req, route) or uses_beam_search(req)


def streams_alike(req: ClientRequest) -> bool:
    """Whether a non-streaming request that is not ``computed_alone`` may be
    decoded as a stream: vLLM refuses ``stream_options`` without a stream
    (the client must see that 400)."""
    return not req.obj.get("stream_options")


def several_requests(req: ClientRequest, route: Route) -> bool:
    """Whether vLLM runs the request as several requests of its own: more
    than one choice (``n`` > 1) or, for completions, more than one prompt.

    Each of them on a decode would pull the same prefill's KV (the prefill
    returns the params of one): the producer frees it after the first pull,
    and a longer prompt than the prefill's fails NIXL's worker, which stops
    the decode's engine (docs/wire.md, "Several choices or prompts"). An
    ``n`` vLLM refuses counts as one: its 400 then comes from the prefill.
    """
    obj = req.obj
    try:
        n = _vllm_int(obj.get("n"))
    except pydantic.ValidationError:
        n = None
    if n is not None and n > 1:
        return True
    if route is not Route.COMPLETIONS:
        return False
    return _num_prompts(obj.get("prompt")) + _num_prompts(obj.get("prompt_embeds")) > 1


def wants_prompt_logprobs(req: ClientRequest, route: Route) -> bool:
    """Whether vLLM computes the request's prompt logprobs: then it reads no
    KV it did not compute itself (``skip_reading_prefix_cache``), and a
    decode would prefill locally whatever the prefill sent.

    As vLLM reads it: ``prompt_logprobs`` set, or ``echo`` with
    ``logprobs`` (completions) or with ``top_logprobs``, whose default is 0
    (chat). A value vLLM refuses counts as unset: its 400 then comes from the
    prefill.
    """
    obj = req.obj
    try:
        if _vllm_int(obj.get("prompt_logprobs")) is not None:
            return True
        if not _vllm_bool(obj.get("echo")):
            return False
        if route is Route.CHAT:
            return True
        return _vllm_int(obj.get("logprobs")) is not None
    except pydantic.ValidationError:
        return False


def returns_token_ids(req: ClientRequest) -> bool:
    """Whether the client asked for token ids (``return_token_ids``), as
    vLLM reads it."""
    return _lax_bool(req.obj.get("return_token_ids"))


def uses_beam_search(req: ClientRequest) -> bool:
    """Whether vLLM runs the request as a beam search, whose steps are
    requests of its own without the ``kv_transfer_params``: the prefill's KV
    would never be sent, and the decode would prefill locally anyway
    (docs/wire.md, "Beam search"). A value vLLM refuses counts as False:
    its 400 then comes from the prefill.
    """
    return _lax_bool(req.obj.get("use_beam_search"))


def _num_prompts(value: Any) -> int:
    """The prompts of a completions ``prompt`` or ``prompt_embeds`` value: a
    list of token ids is one, a list of strings or of token-id lists one
    each."""
    if isinstance(value, list):
        return 1 if value and isinstance(value[0], int) else len(value)
    return 0 if value is None else 1


def stream_body(req: ClientRequest, interval: int = 1) -> bytes:
    """A non-streaming request's body, asking for a stream with its usage,
    ``interval`` tokens a chunk after the first (vLLM's ``stream_interval``,
    not sent when 1).

    Raises:
        BadRequest: the body is nested too deeply to encode.
    """
    obj = dict(req.obj)
    obj["stream"] = True
    obj["stream_options"] = {"include_usage": True}
    if interval > 1:
        obj["stream_interval"] = interval
    return _encode(obj)


def decode_body(raw: bytes, kv_params: bytes | None) -> bytes:
    """The decode leg's body: ``raw`` plus the prefill's params verbatim.

    ``raw`` is the client's body (or ``stream_body``'s); ``kv_params`` is
    the raw JSON value the prefill returned; ``None`` (no params) sends
    ``raw`` unchanged, so the decode prefills locally.
    """
    if kv_params is None:
        return raw
    head = raw.rstrip()
    # parse_request guarantees a non-empty object, so a comma is always right.
    return b"".join((head[:-1], b',"kv_transfer_params":', kv_params, b"}"))


class _PrefillReply(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")


_decode_reply = msgspec.json.Decoder(_PrefillReply).decode


def kv_params_of(reply: bytes) -> bytes | None:
    """The raw ``kv_transfer_params`` object of a prefill's reply, or None
    (absent or null).

    Raises:
        ValueError: the reply is not a JSON object (or is nested too deeply
            to parse), or its ``kv_transfer_params`` is not an object: no
            decode could use it.
    """
    try:
        raw = bytes(_decode_reply(reply).kv_transfer_params)
    except (msgspec.DecodeError, RecursionError):
        raise ValueError("prefill reply is not a JSON object") from None
    if raw == b"null":
        return None
    if not raw.startswith(b"{"):
        raise ValueError("prefill reply's kv_transfer_params is not an object")
    return raw


class _KvIds(msgspec.Struct):
    remote_request_id: str | None = None


_decode_ids = msgspec.json.Decoder(_KvIds).decode


def remote_request_id(kv_params: bytes) -> str | None:
    """The prefill's internal request id from its params, for aborting held KV."""
    try:
        return _decode_ids(kv_params).remote_request_id
    except (msgspec.DecodeError, RecursionError):
        return None


def prefix_key(req: ClientRequest, route: Route, size: int) -> bytes:
    """The first ``size`` bytes of the prompt (or messages), for prefix_hash.

    Raises:
        BadRequest: the prompt is nested too deeply to encode.
    """
    obj = req.obj
    if route is Route.CHAT:
        value = obj.get("messages")
    else:
        value = obj.get("prompt") or obj.get("prompt_embeds")
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")[:size]
    return _encode(value)[:size]
