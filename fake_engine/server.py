"""The fake engine's HTTP server (aiohttp): vLLM's OpenAI-compatible routes,
``/metrics``, the abort route, fault administration, and the internal KV
pull route consumers read a producer's blocks through."""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from engine_patch.log import get_logger
from fake_engine.config import EngineConfig, FaultConfig, FaultKind, FaultSide
from fake_engine.engine import Engine, EngineStoppedError
from fake_engine.protocol import (
    VALIDATION_ERROR_TYPE,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    ResponseBuilder,
    error_body,
    json_error,
    models_response,
    now,
    parse_request,
    system_fingerprint,
    validation_error,
    vllm_validation_error,
)
from fake_engine.request import EngineRequest, RequestOutput, SamplingOptions
from fake_engine.tokenizer import (
    VOCAB_SIZE,
    ChatTemplateError,
    apply_chat_template,
    decode,
    encode,
)
from fake_engine.transfer import (
    PULL_PATH,
    PullError,
    TransferError,
    decode_pull_request,
)

logger = get_logger(__name__)

_json = msgspec.json.Encoder()
_BYTE_POSITION = re.compile(r"byte (\d+)")
# The largest request body taken (long prompts, pulled KV requests).
MAX_BODY_BYTES = 64 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=_json.encode(body), status=status, content_type="application/json"
    )


def error_response(error: RequestError) -> web.Response:
    return json_response(
        error_body(error.message, error.err_type, error.status, error.param),
        status=int(error.status),
    )


def _sse(body: Any) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _shows_nothing(out: RequestOutput, num_output: int, *, echoes: bool) -> bool:
    """Whether a stream skips ``out``: no text and no tokens while none were
    output yet (``num_output`` counts ``out``'s), and no echo to send. vLLM's
    stream generators skip such an output even when it finishes the request
    (one aborted before its first token): its stream then has no choice chunk."""
    return not out.text and num_output == 0 and not echoes


def _joined(held: RequestOutput, out: RequestOutput) -> RequestOutput:
    """``out`` with the tokens and text of ``held``, an output not yet sent,
    before its own."""
    return RequestOutput(
        held.token_ids + out.token_ids,
        held.text + out.text,
        out.finish_reason,
        out.stop_reason,
        out.error,
        out.kv_transfer_params,
    )


def _fingerprint(config: EngineConfig) -> str:
    """The engine's ``system_fingerprint``: it changes with what vLLM's config
    hash covers (the model, its shape and cache), not with faults or ids."""
    key = (
        config.model,
        config.layers,
        config.kv_heads,
        config.head_size,
        config.dtype,
        config.block_size,
        config.max_model_len,
    )
    return system_fingerprint(config.tp_size, repr(key))


class FaultUpdate(BaseModel):
    """``POST /kvguard/faults``: the fault flags, as JSON."""

    model_config = ConfigDict(extra="forbid")

    fault: FaultKind
    side: FaultSide = FaultSide.PRODUCER
    rate: float = 1.0
    count: int | None = None
    delay_s: float = 1.0


@web.middleware
async def _framework_errors(
    request: web.Request, handler: Handler
) -> web.StreamResponse:
    """Unknown routes and methods answer as FastAPI does."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, status=405)


class EngineServer:
    """Serves one engine over HTTP."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.app = web.Application(
            middlewares=[_framework_errors], client_max_size=MAX_BODY_BYTES
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.post("/inference/v1/abort_requests", self.abort_requests),
                web.get("/kvguard/faults", self.get_faults),
                web.post("/kvguard/faults", self.set_faults),
                web.post(PULL_PATH, self.pull),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.system_fingerprint = _fingerprint(engine.config)

    async def start(
        self, host: str, port: int, advertise_host: str | None = None
    ) -> int:
        """Start the engine and listen; returns the port (``port`` 0: a free one)."""
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        if advertise_host is None:
            advertise_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
        self.engine.host = advertise_host
        self.engine.port = bound
        await self.engine.start()
        return int(bound)

    async def stop(self) -> None:
        await self.engine.stop()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # OpenAI routes.

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_request(CompletionRequest, await self._read_json(request))
            body.check_supported()
            self._check_model(body.model)
            self._check_output_budget(body.max_tokens, "max_tokens")
            prompt_ids = self._completion_prompt(body.prompt)
            max_tokens = self._max_tokens(
                len(prompt_ids),
                body.max_tokens,
                body.min_tokens,
                from_text=isinstance(body.prompt, str),
            )
        except RequestError as e:
            return error_response(e)
        base = request.headers.get("X-Request-Id") or body.request_id
        response_id = f"cmpl-{base}"
        engine_request = self._engine_request(
            f"{response_id}-0-{uuid.uuid4().hex[:8]}",
            prompt_ids,
            body,
            max_tokens,
            aliases=(base, response_id, f"{response_id}-0"),
        )
        # vLLM echoes the prompt's ids instead of its text where both are asked.
        builder = self._builder(
            body,
            response_id,
            prompt_ids,
            echo=decode(prompt_ids) if body.echo and not body.return_token_ids else "",
            echoes=bool(body.echo),
        )
        return await self._respond(
            request, engine_request, builder, bool(body.stream), body.stream_interval
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_request(ChatCompletionRequest, await self._read_json(request))
            body.check_supported()
            self._check_model(body.model)
            budget_param = (
                "max_completion_tokens"
                if body.max_completion_tokens is not None
                else "max_tokens"
            )
            requested = getattr(body, budget_param)
            self._check_output_budget(requested, budget_param)
            try:
                prompt = apply_chat_template(
                    [m.model_dump(exclude_none=True) for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                )
            except ChatTemplateError as e:
                raise RequestError(str(e), param="messages") from None
            prompt_ids = encode(prompt)
            max_tokens = self._max_tokens(
                len(prompt_ids), requested, body.min_tokens, from_text=True
            )
        except RequestError as e:
            return error_response(e)
        base = request.headers.get("X-Request-Id") or body.request_id
        response_id = f"chatcmpl-{base}"
        engine_request = self._engine_request(
            f"{response_id}-{uuid.uuid4().hex[:8]}",
            prompt_ids,
            body,
            max_tokens,
            aliases=(base, response_id),
        )
        builder = self._builder(body, response_id, prompt_ids)
        return await self._respond(
            request, engine_request, builder, bool(body.stream), body.stream_interval
        )

    @property
    def model_name(self) -> str:
        return self.engine.config.model

    async def models(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return json_response(models_response(config.model, config.max_model_len, now()))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.stopped else 200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.engine.metrics.render(),
            headers={"Content-Type": self.engine.metrics.content_type},
        )

    async def abort_requests(self, request: web.Request) -> web.Response:
        """vLLM's ``/inference/v1/abort_requests``; also drops held KV."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            return self._http_error(HTTPStatus.BAD_REQUEST, f"JSON decode error: {e}")
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            return self._http_error(
                HTTPStatus.BAD_REQUEST, "Missing 'request_ids' in request body"
            )
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return self._http_error(
                HTTPStatus.BAD_REQUEST, "'request_ids' must be a list of strings"
            )
        found = self.engine.abort(ids)
        logger.info("Aborted %d of %d requests.", found, len(ids))
        return web.Response(status=200)

    # Fault administration.

    def _fault_state(self) -> dict[str, Any]:
        faults = self.engine.faults
        config = faults.config
        return {
            "fault": config.fault.value,
            "side": config.side.value,
            "rate": config.rate,
            "count": config.count,
            "delay_s": config.delay_s,
            "remaining": faults.remaining,
            "injected": {f"{f}/{s}": n for (f, s), n in faults.injected.items()},
        }

    async def get_faults(self, request: web.Request) -> web.Response:
        if not self.engine.config.enable_fault_admin:
            raise web.HTTPNotFound()
        return json_response(self._fault_state())

    async def set_faults(self, request: web.Request) -> web.Response:
        if not self.engine.config.enable_fault_admin:
            raise web.HTTPNotFound()
        try:
            update = FaultUpdate.model_validate(await self._read_json(request))
            fault = FaultConfig(**update.model_dump())
        except ValidationError as e:
            return error_response(validation_error(e))
        except ValueError as e:  # RequestError included.
            message = e.message if isinstance(e, RequestError) else str(e)
            return error_response(RequestError(message))
        self.engine.configure_faults(fault)
        logger.warning("Fault injection set: %s", fault)
        return json_response(self._fault_state())

    # The KV pull (producer side).

    async def pull(self, request: web.Request) -> web.StreamResponse:
        try:
            pull = decode_pull_request(await request.read())
            parts = await self.engine.serve_pull(pull)
        except TransferError as e:
            return self._http_error(HTTPStatus.BAD_REQUEST, str(e))
        except PullError as e:
            return self._http_error(HTTPStatus(e.status), str(e))
        response = web.StreamResponse(
            headers={"Content-Type": "application/octet-stream"}
        )
        response.content_length = sum(len(part) for part in parts)
        await response.prepare(request)
        for part in parts:
            await response.write(part)
        await response.write_eof()
        return response

    # Helpers.

    @staticmethod
    def _http_error(status: HTTPStatus, message: str) -> web.Response:
        """An HTTPException as vLLM answers it."""
        return json_response(
            error_body(message, status.phrase, status), status=int(status)
        )

    @staticmethod
    async def _read_json(request: web.Request) -> Any:
        """The body as JSON, refused as vLLM refuses it.

        Raises:
            RequestError: If it is not JSON.

        """
        if request.content_type != "application/json":
            raise RequestError(
                "1 validation error:\n  Unsupported Media Type: Only "
                "'application/json' is allowed",
                err_type=VALIDATION_ERROR_TYPE,
            )
        data = await request.read()
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError as e:
            match = _BYTE_POSITION.search(str(e))
            raise json_error(int(match.group(1)) if match else 0, str(e)) from None

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist. "
                f"Valid aliases: {self.model_name}.",
                err_type="NotFoundError",
                status=HTTPStatus.NOT_FOUND,
                param="model",
            )

    @staticmethod
    def _completion_prompt(prompt: Any) -> list[int]:
        """Token ids of a completion's single prompt.

        Raises:
            RequestError: For several prompts or ids outside the vocabulary.

        """
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise RequestError(
                    "Batched prompts are not supported by the fake engine.",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode(prompt)
            if not ids:  # vLLM's input processor refuses it before scheduling
                raise RequestError("The decoder prompt cannot be empty")
            return ids
        ids = list(prompt)
        if not ids:
            raise RequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.",
                param="prompt",
            )
        if ids and (largest := max(ids)) >= VOCAB_SIZE:
            # vLLM's Renderer.validate_token_ids reports the largest id.
            raise vllm_validation_error(
                f"Token id {largest} is out of vocabulary", param="prompt"
            )
        return ids

    def _check_output_budget(self, requested: int | None, param: str) -> None:
        """Refuse an output budget above max_model_len, as vLLM's
        ``TokenizeParams`` does before tokenizing (a smaller one that the
        prompt leaves no room for is clamped by :meth:`_max_tokens`).

        Raises:
            RequestError: If ``requested`` exceeds max_model_len.

        """
        max_model_len = self.engine.config.max_model_len
        if requested is not None and requested > max_model_len:
            raise vllm_validation_error(
                f"{param}={requested} cannot be greater than "
                f"max_model_len={max_model_len}. Please request fewer output tokens.",
                param=param,
                value=requested,
            )

    def _max_tokens(
        self,
        num_prompt_tokens: int,
        requested: int | None,
        min_tokens: int,
        *,
        from_text: bool,
    ) -> int:
        """The request's output budget, as vLLM's ``get_max_tokens`` clamps it
        and ``SamplingParams`` checks it against ``min_tokens``.

        ``from_text``: the prompt was text, which vLLM tokenizes to at most
        max_model_len + 1 tokens (so it counts "at least" that many).

        Raises:
            RequestError: If the prompt is too long or leaves no room.

        """
        max_model_len = self.engine.config.max_model_len
        if num_prompt_tokens > max_model_len:
            count = (
                min(num_prompt_tokens, max_model_len + 1)
                if from_text
                else num_prompt_tokens
            )
            qualifier = "at least " if count == max_model_len + 1 else ""
            raise vllm_validation_error(
                f"This model's maximum context length is {max_model_len} tokens. "
                f"However, your prompt contains {qualifier}{count} input tokens, "
                "which exceeds this limit even without any output tokens. Please "
                "reduce the length of the input prompt.",
                param="input_tokens",
                value=count,
            )
        available = max_model_len - num_prompt_tokens
        value = available if requested is None else min(requested, available)
        if value < 1:
            raise vllm_validation_error(
                f"max_tokens must be at least 1, got {value}.",
                param="max_tokens",
                value=value,
            )
        if min_tokens > value:
            # SamplingParams._verify_args names no parameter here.
            raise vllm_validation_error(
                f"min_tokens must be less than or equal to max_tokens={value}, "
                f"got {min_tokens}."
            )
        return value

    def _engine_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        aliases: tuple[str, ...],
    ) -> EngineRequest:
        params = body.kv_transfer_params
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=SamplingOptions(
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                stop=body.stop_strings,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
            ),
            kv_transfer_params=dict(params) if params is not None else None,
            aliases=aliases,
        )

    def _builder(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        response_id: str,
        prompt_ids: list[int],
        *,
        echo: str = "",
        echoes: bool = False,
    ) -> ResponseBuilder:
        """The response's builder, in the request's API (chat or completions)."""
        return ResponseBuilder(
            chat=isinstance(body, ChatCompletionRequest),
            response_id=response_id,
            model=self.model_name,
            prompt_token_ids=prompt_ids,
            return_token_ids=bool(body.return_token_ids),
            continuous_usage=body.continuous_usage,
            include_usage=body.include_usage,
            echo=echo,
            echoes=echoes,
            system_fingerprint=self.system_fingerprint,
        )

    def _submit(self, engine_request: EngineRequest) -> RequestError | None:
        try:
            self.engine.add_request(engine_request)
        except EngineStoppedError as e:
            return RequestError(
                str(e),
                err_type="ServiceUnavailableError",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
            )
        return None

    async def _respond(
        self,
        request: web.Request,
        engine_request: EngineRequest,
        builder: ResponseBuilder,
        stream: bool,
        stream_interval: int | None = None,
    ) -> web.StreamResponse:
        """Run the request on the engine and answer it, whole or streamed
        (``stream_interval`` tokens a chunk, as vLLM batches them)."""
        if stream:
            return await self._stream_response(
                request, engine_request, builder, stream_interval or 1
            )
        return await self._full_response(engine_request, builder)

    async def _full_response(
        self, engine_request: EngineRequest, builder: ResponseBuilder
    ) -> web.Response:
        if (error := self._submit(engine_request)) is not None:
            return error_response(error)
        text: list[str] = []
        token_ids: list[int] = []
        try:
            while True:
                out = await engine_request.outputs.get()
                text.append(out.text)
                token_ids.extend(out.token_ids)
                if out.finished:
                    break
        finally:
            if not engine_request.finished:
                self.engine.abort([engine_request.request_id])
        if out.finish_reason == "error":
            return error_response(
                RequestError(
                    out.error or "Internal server error",
                    err_type="InternalServerError",
                    status=HTTPStatus.INTERNAL_SERVER_ERROR,
                )
            )
        return json_response(
            builder.response(
                text="".join(text),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=token_ids,
                kv_transfer_params=out.kv_transfer_params,
            )
        )

    async def _stream_response(
        self,
        request: web.Request,
        engine_request: EngineRequest,
        builder: ResponseBuilder,
        interval: int,
    ) -> web.StreamResponse:
        """The request's SSE stream. With ``interval`` > 1 its outputs are
        held until that many tokens are pending, as vLLM's output processor
        holds them: the first and the last are sent at once."""
        if (error := self._submit(engine_request)) is not None:
            return error_response(error)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        try:
            await response.prepare(request)
            first = True
            num_output = 0
            held: RequestOutput | None = None
            role_chunk = builder.role_chunk()
            while True:
                out = await engine_request.outputs.get()
                if role_chunk is not None:
                    await response.write(_sse(role_chunk))
                    role_chunk = None
                if out.finish_reason == "error":
                    status = HTTPStatus.INTERNAL_SERVER_ERROR
                    message = out.error or "Internal server error"
                    body = error_body(message, "InternalServerError", status)
                    await response.write(_sse(body))
                    break
                if held is not None:
                    out = _joined(held, out)
                    held = None
                if (
                    interval > 1
                    and not out.finished
                    and num_output > 0
                    and len(out.token_ids) < interval
                ):
                    held = out
                    continue
                num_output += len(out.token_ids)
                if not _shows_nothing(out, num_output, echoes=first and builder.echoes):
                    chunk = builder.chunk(
                        text=out.text,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        token_ids=out.token_ids,
                        first=first,
                        num_output=num_output,
                    )
                    await response.write(_sse(chunk))
                    first = False
                if out.finished:
                    if (usage := builder.usage_chunk(num_output)) is not None:
                        await response.write(_sse(usage))
                    break
            await response.write(_DONE)
            await response.write_eof()
        except ConnectionResetError:
            logger.info("Client of request %s went away.", engine_request.request_id)
        finally:
            if not engine_request.finished:
                self.engine.abort([engine_request.request_id])
        return response
