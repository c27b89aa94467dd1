"""The fake engine's HTTP server (aiohttp): vLLM's OpenAI-compatible routes,
``/metrics``, the abort route, fault administration, and the internal KV
pull route consumers read a producer's blocks through."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from engine_patch.hashing import splitmix64
from engine_patch.log import get_logger
from fake_engine.choices import (
    Beam,
    Choice,
    ChoiceStream,
    grown,
    merged,
    whole,
)
from fake_engine.config import EngineConfig, FaultConfig, FaultKind, FaultSide
from fake_engine.engine import Engine, EngineStoppedError
from fake_engine.openai_base import (
    VALIDATION_ERROR_TYPE,
    RequestError,
    error_body,
    json_error,
    validation_error,
    vllm_validation_error,
)
from fake_engine.protocol import (
    VLLM_VERSION,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    check_request_chat_template,
    models_response,
    now,
    parse_request,
    system_fingerprint,
    usage,
)
from fake_engine.request import (
    EngineRequest,
    RequestOutput,
    RequestStatus,
    SamplingOptions,
)
from fake_engine.tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    detokenize_response,
    parse_tokenize_request,
    tokenize_response,
)
from fake_engine.tokenizer import (
    VOCAB_SIZE,
    ChatTemplateError,
    NotMultimodalError,
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
                # SageMaker's health check, as vLLM serves it.
                web.get("/ping", self.health),
                web.post("/ping", self.health),
                web.get("/version", self.version),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
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
            body.check_renderable()
            self._check_output_budget(body.max_tokens, "max_tokens")
            self._check_truncation(body.truncate_prompt_tokens)
            # An echo without generation samples one token, as vLLM's
            # CompletionRequest asks, and answers with the prompt alone.
            echo_only = bool(body.echo) and body.max_tokens == 0
            requested = 1 if echo_only else body.max_tokens
            prompts = [
                (
                    ids,
                    self._max_tokens(
                        len(ids), requested, body.min_tokens, from_text=from_text
                    ),
                )
                for ids, from_text in self._completion_prompts(body)
            ]
            body.check_constraint()
        except RequestError as e:
            return error_response(e)
        if body.stream and body.use_beam_search:
            return error_response(
                RequestError("Streaming is not currently supported with beam search")
            )
        base = request.headers.get("X-Request-Id") or body.request_id
        response_id = f"cmpl-{base}"
        make = self._beam_choices if body.use_beam_search else self._choices
        choices = []
        for index, (prompt_ids, max_tokens) in enumerate(prompts):
            # vLLM echoes the prompt's ids instead of its text where both are asked.
            echo = decode(prompt_ids) if body.echo and not body.return_token_ids else ""
            choices.append(
                make(
                    f"{response_id}-{index}-{uuid.uuid4().hex[:8]}",
                    prompt_ids,
                    body,
                    max_tokens,
                    (base, response_id, f"{response_id}-{index}"),
                    self._builder(
                        body,
                        response_id,
                        prompt_ids,
                        echo=echo,
                        echoes=bool(body.echo),
                        echo_only=echo_only,
                        index=index * body.num_choices,
                    ),
                )
            )
        try:
            made = await asyncio.gather(*choices)
        except RequestError as e:  # a beam search's engine stopped
            return error_response(e)
        return await self._respond(
            request,
            [choice for prompt_choices in made for choice in prompt_choices],
            sum(len(prompt_ids) for prompt_ids, _ in prompts),
            bool(body.stream),
            body.stream_interval,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_request(ChatCompletionRequest, await self._read_json(request))
            body.check_supported()
            self._check_model(body.model)
            body.check_renderable()
            budget_param = (
                "max_completion_tokens"
                if body.max_completion_tokens is not None
                else "max_tokens"
            )
            requested = getattr(body, budget_param)
            self._check_output_budget(requested, budget_param)
            self._check_truncation(body.truncate_prompt_tokens)
            prompt_ids = self._prompt_ids(self._render_chat(body), body)
            max_tokens = self._max_tokens(
                len(prompt_ids), requested, body.min_tokens, from_text=True
            )
            body.check_constraint()
        except RequestError as e:
            return error_response(e)
        base = request.headers.get("X-Request-Id") or body.request_id
        response_id = f"chatcmpl-{base}"
        make = self._beam_choices if body.use_beam_search else self._choices
        try:
            choices = await make(
                f"{response_id}-{uuid.uuid4().hex[:8]}",
                prompt_ids,
                body,
                max_tokens,
                (base, response_id),
                self._builder(body, response_id, prompt_ids),
            )
        except RequestError as e:  # a beam search's engine stopped
            return error_response(e)
        return await self._respond(
            request, choices, len(prompt_ids), bool(body.stream), body.stream_interval
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: a prompt's ids, or a conversation's as a
        chat request renders it."""
        try:
            body = parse_tokenize_request(await self._read_json(request))
            self._check_model(body.model)
            if isinstance(body, TokenizeChatRequest):
                check_request_chat_template(
                    body.chat_template, body.chat_template_kwargs
                )
                token_ids = self._render_chat(body)
            else:
                token_ids = encode(body.prompt)
        except RequestError as e:
            return error_response(e)
        return json_response(
            tokenize_response(
                token_ids, self.engine.config.max_model_len, body.return_token_strs
            )
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: the text of token ids."""
        try:
            body = parse_request(DetokenizeRequest, await self._read_json(request))
            self._check_model(body.model)
        except RequestError as e:
            return error_response(e)
        return json_response(detokenize_response(body.tokens))

    def _render_chat(
        self, body: ChatCompletionRequest | TokenizeChatRequest
    ) -> list[int]:
        """The ids of a conversation as the chat template renders it.

        Raises:
            RequestError: vLLM's 400 for content this model cannot read or a
                conversation the template refuses.
        """
        try:
            prompt = apply_chat_template(
                [m.model_dump(exclude_none=True) for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
        except NotMultimodalError:
            raise RequestError(f"{self.model_name} is not a multimodal model") from None
        except ChatTemplateError as e:
            raise RequestError(str(e)) from None
        return encode(prompt)

    @property
    def model_name(self) -> str:
        return self.engine.config.model

    async def models(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return json_response(models_response(config.model, config.max_model_len, now()))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.stopped else 200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

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
        try:
            await response.prepare(request)
            for part in parts:
                await response.write(part)
            await response.write_eof()
        except ConnectionResetError:
            # The consumer gave the load up meanwhile (its KV was released
            # as pulled once gathered): nothing is wrong with this engine.
            logger.info("Consumer of request %s went away mid-pull.", pull.request_id)
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

    def _completion_prompts(
        self, body: CompletionRequest
    ) -> list[tuple[list[int], bool]]:
        """Token ids of a completion's prompts, truncated where asked, each
        with whether it was text.

        Raises:
            RequestError: For no prompt, an empty one or ids outside the
                vocabulary.

        """
        # Not None: without one, prompt_embeds were refused.
        prompt: Any = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise RequestError("You must pass at least one prompt")
        out = []
        for one in prompts:
            from_text = isinstance(one, str)
            ids = self._prompt_ids(
                encode(one) if isinstance(one, str) else list(one), body
            )
            if not from_text and (largest := max(ids)) >= VOCAB_SIZE:
                # vLLM's Renderer.validate_token_ids reports the largest id.
                raise vllm_validation_error(
                    f"Token id {largest} is out of vocabulary", param="prompt"
                )
            out.append((ids, from_text))
        return out

    def _check_truncation(self, truncate_prompt_tokens: int | None) -> None:
        """Refuse a truncation longer than the context, as vLLM's
        ``TokenizeParams`` does.

        Raises:
            RequestError: If ``truncate_prompt_tokens`` exceeds max_model_len.
        """
        max_model_len = self.engine.config.max_model_len
        if (
            truncate_prompt_tokens is not None
            and truncate_prompt_tokens > max_model_len
        ):
            raise vllm_validation_error(
                f"truncate_prompt_tokens={truncate_prompt_tokens} cannot be greater "
                f"than max_model_len = {max_model_len}. Please request a smaller "
                "truncation size.",
                param="truncate_prompt_tokens",
                value=truncate_prompt_tokens,
            )

    def _prompt_ids(
        self, ids: list[int], body: CompletionRequest | ChatCompletionRequest
    ) -> list[int]:
        """A prompt's ids cut to ``truncate_prompt_tokens``, from the left
        (its end kept) unless ``truncation_side`` is "right"; -1 keeps one
        token less than the context, as vLLM's ``max_truncation_tokens``.

        Raises:
            RequestError: If no token is left, as vLLM's input processor
                refuses an empty prompt before scheduling.
        """
        keep = body.truncate_prompt_tokens
        if keep is not None:
            if keep < 0:
                keep = self.engine.config.max_model_len - 1
            if body.truncation_side == "right":
                ids = ids[:keep]
            else:
                ids = ids[max(0, len(ids) - keep) :]
        if not ids:
            raise RequestError("The decoder prompt cannot be empty")
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
        seed: int = 0,
    ) -> EngineRequest:
        params = body.kv_transfer_params
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            seed=seed,
            sampling=SamplingOptions(
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                stop=body.stop_strings,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                logprobs=body.sample_logprobs,
                logprob_token_ids=body.requested_logprob_token_ids,
                logit_bias=body.sampling_logit_bias,
                bad_words_token_ids=body.bad_words_token_ids,
                allowed_token_ids=None
                if body.allowed_token_ids is None
                else frozenset(body.allowed_token_ids),
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
        echo_only: bool = False,
        index: int = 0,
    ) -> ResponseBuilder:
        """The builder of a choice (``index``) of the response, in the
        request's API (chat or completions)."""
        prompt_logprobs = None
        if (count := body.num_prompt_logprobs) is not None:
            prompt_logprobs = self.engine.model.prompt_logprobs(prompt_ids, count)
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
            echo_only=echo_only,
            system_fingerprint=self.system_fingerprint,
            index=index,
            logprobs=body.num_output_top_logprobs,
            prompt_logprobs=prompt_logprobs,
            return_all_logprobs=body.requested_logprob_token_ids is not None,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
        )

    async def _choices(
        self,
        request_id: str,
        prompt_ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        aliases: tuple[str, ...],
        builder: ResponseBuilder,
    ) -> list[Choice]:
        """The ``n`` choices of one prompt, each an engine request (named as
        vLLM names parallel sampling's children) with its builder. The first
        is the model's plain continuation; each other has a seed of its
        own, so that its text differs as a sampled one would."""
        n = body.num_choices
        return [
            Choice(
                self._engine_request(
                    f"{i}_{request_id}" if n > 1 else request_id,
                    prompt_ids,
                    body,
                    max_tokens,
                    aliases,
                    seed=splitmix64(i) if i else 0,
                ),
                dataclasses.replace(builder, index=builder.index + i),
            )
            for i in range(n)
        ]

    async def _beam_choices(
        self,
        request_id: str,
        prompt_ids: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        aliases: tuple[str, ...],
        builder: ResponseBuilder,
    ) -> list[Choice]:
        """The ``n`` best beams of a beam search, answered: vLLM's server
        search, one engine request per beam and token, each asking for twice
        the width in logprobs, and each beam a choice.

        Raises:
            RequestError: If the engine stopped.
        """
        width = body.num_choices
        beams = [Beam([], 0.0, [])]
        done: list[Beam] = []
        failed: RequestOutput | None = None
        for _ in range(max_tokens):
            outputs = await self._beam_step(
                request_id, prompt_ids, beams, width, aliases
            )
            if failed := next((o for o in outputs if o.finish_reason == "error"), None):
                break
            if any(o.finish_reason == "abort" for o in outputs):
                for beam in beams:
                    beam.finish_reason = "abort"
                break
            beams = grown(beams, outputs, body, done)[:width]
            if not beams:
                break
        if failed is not None:
            finals = [failed]
        else:
            best = sorted(
                done + beams,
                key=lambda b: b.score(len(prompt_ids), body.length_penalty),
                reverse=True,
            )[:width]
            finals = [beam.output(body.skip_special_tokens) for beam in best]
        answered = []
        for i, final in enumerate(finals):
            request = EngineRequest(
                request_id=f"{request_id}-{i}",
                prompt_token_ids=prompt_ids,
                sampling=SamplingOptions(max_tokens=max_tokens),
                status=RequestStatus.FINISHED,
            )
            request.outputs.put_nowait(final)
            answered.append(
                Choice(request, dataclasses.replace(builder, index=builder.index + i))
            )
        return answered

    async def _beam_step(
        self,
        request_id: str,
        prompt_ids: list[int],
        beams: list[Beam],
        width: int,
        aliases: tuple[str, ...],
    ) -> list[RequestOutput]:
        """One token of every beam, with twice ``width`` logprobs.

        Raises:
            RequestError: If the engine stopped.
        """
        step = [
            EngineRequest(
                request_id=f"{request_id}-{uuid.uuid4().hex[:8]}-beam-{i}",
                prompt_token_ids=prompt_ids + beam.token_ids,
                sampling=SamplingOptions(max_tokens=1, logprobs=2 * width),
                aliases=aliases,
            )
            for i, beam in enumerate(beams)
        ]
        if (error := self._submit(step)) is not None:
            raise error
        try:
            return list(await asyncio.gather(*(whole(r) for r in step)))
        finally:
            self._abort_unfinished(step)

    def _submit(self, requests: list[EngineRequest]) -> RequestError | None:
        """Add every request to the engine, or none."""
        try:
            for request in requests:
                self.engine.add_request(request)
        except EngineStoppedError as e:
            self._abort_unfinished(requests)
            return RequestError(
                str(e),
                err_type="ServiceUnavailableError",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
            )
        return None

    def _abort_unfinished(self, requests: list[EngineRequest]) -> None:
        unfinished = [r.request_id for r in requests if not r.finished]
        if unfinished:
            self.engine.abort(unfinished)

    async def _respond(
        self,
        request: web.Request,
        choices: list[Choice],
        num_prompt: int,
        stream: bool,
        stream_interval: int | None = None,
    ) -> web.StreamResponse:
        """Run the choices' requests on the engine and answer them, whole or
        streamed (``stream_interval`` tokens a chunk, as vLLM batches them);
        ``num_prompt`` counts the tokens of all prompts once."""
        requests = [c.request for c in choices]
        # A beam search's choices come answered.
        if (error := self._submit([r for r in requests if not r.finished])) is not None:
            return error_response(error)
        try:
            if stream:
                return await self._stream_response(
                    request, choices, num_prompt, stream_interval or 1
                )
            return await self._full_response(choices, num_prompt)
        finally:
            self._abort_unfinished(requests)

    async def _full_response(
        self, choices: list[Choice], num_prompt: int
    ) -> web.Response:
        outputs = await asyncio.gather(*(whole(c.request) for c in choices))
        for out in outputs:
            if out.finish_reason == "error":
                return error_response(
                    RequestError(
                        out.error or "Internal server error",
                        err_type="InternalServerError",
                        status=HTTPStatus.INTERNAL_SERVER_ERROR,
                    )
                )
        bodies = [
            choice.builder.response(
                text=out.text,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                token_ids=out.token_ids,
                kv_transfer_params=out.kv_transfer_params,
                logprobs=out.logprobs,
            )
            for choice, out in zip(choices, outputs, strict=True)
        ]
        body = bodies[0]
        if len(bodies) > 1:
            body["choices"] = [b["choices"][0] for b in bodies]
            body["usage"] = usage(
                num_prompt, sum(len(out.token_ids) for out in outputs)
            )
        return json_response(body)

    async def _stream_response(
        self,
        request: web.Request,
        choices: list[Choice],
        num_prompt: int,
        interval: int,
    ) -> web.StreamResponse:
        """The SSE stream of the choices' outputs, in the order the engine
        makes them. With ``interval`` > 1 a choice's outputs are held until
        that many tokens are pending, as vLLM's output processor holds them:
        its first and its last are sent at once."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        streams = [ChoiceStream(c.builder) for c in choices]
        unfinished = len(streams)
        try:
            await response.prepare(request)
            role_chunks = [c.builder.role_chunk() for c in choices]
            outputs = merged([c.request for c in choices])
            async with contextlib.aclosing(outputs):
                async for index, out in outputs:
                    for role_chunk in role_chunks:
                        if role_chunk is not None:
                            await response.write(_sse(role_chunk))
                    role_chunks = []
                    if out.finish_reason == "error":
                        status = HTTPStatus.INTERNAL_SERVER_ERROR
                        message = out.error or "Internal server error"
                        body = error_body(message, "InternalServerError", status)
                        await response.write(_sse(body))
                        break
                    if (chunk := streams[index].chunk(out, interval)) is not None:
                        await response.write(_sse(chunk))
                    if out.finished:
                        unfinished -= 1
                        if not unfinished:
                            num_output = sum(s.num_output for s in streams)
                            usage_chunk = choices[0].builder.usage_chunk(
                                num_prompt, num_output
                            )
                            if usage_chunk is not None:
                                await response.write(_sse(usage_chunk))
                            break
            await response.write(_DONE)
            await response.write_eof()
        except ConnectionResetError:
            logger.info(
                "Client of request %s went away.", choices[0].request.request_id
            )
        return response
