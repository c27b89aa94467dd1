"""A request as the fake engine runs it (``engine_patch.host.Request``), its
sampling options, and the outputs it streams to its HTTP handler."""

from __future__ import annotations

import asyncio
import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine_patch.host import FinishReason
from fake_engine.model import Processors, TokenLogprob
from fake_engine.tokenizer import EOS_TOKEN_ID, decode

# Text of finish reasons in responses, as vLLM writes them.
FINISH_REASON_TEXT = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True)
class SamplingOptions:
    """How a request's generation ends (the model itself is deterministic)."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Top logprobs to return with each generated token; None: no logprobs.
    logprobs: int | None = None
    # Tokens whose logprobs to return with each generated token instead of
    # the top ones (vLLM's ``logprob_token_ids``); None: none asked.
    logprob_token_ids: tuple[int, ...] | None = None
    # vLLM's ``logit_bias`` (clamped to [-100, 100]) and ``allowed_token_ids``.
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: frozenset[int] | None = None
    # vLLM's ``bad_words``, tokenized.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @functools.cached_property
    def processors(self) -> Processors:
        """The logits processors sampling goes through once ``min_tokens``
        are generated."""
        return Processors(allowed=self.allowed_token_ids, bias=self.logit_bias)

    @functools.cached_property
    def min_tokens_processors(self) -> Processors:
        """Those until then: vLLM's min-tokens processor also masks the stop
        token ids and EOS (ignored or not)."""
        masked = frozenset((*self.stop_token_ids, EOS_TOKEN_ID))
        return replace(self.processors, masked=masked)

    def processors_after(self, output_token_ids: list[int]) -> Processors:
        """The logits processors the token after ``output_token_ids`` goes
        through: besides the above, vLLM's bad-words processor masks the
        last token of each bad word whose other tokens end the output."""
        processors = (
            self.min_tokens_processors
            if len(output_token_ids) < self.min_tokens
            else self.processors
        )
        if not self.bad_words_token_ids:
            return processors
        banned = frozenset(
            word[-1]
            for word in self.bad_words_token_ids
            if len(word) == 1 or tuple(output_token_ids[1 - len(word) :]) == word[:-1]
        )
        return replace(processors, masked=processors.masked | banned)


@dataclass(frozen=True)
class RemoteSource:
    """Where a consumer request pulls its prompt's KV from
    (the producer's ``kv_transfer_params``)."""

    host: str
    port: int
    engine_id: str
    request_id: str
    block_ids: list[list[int]]

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteSource | None:
        """The source in a consumer's ``kv_transfer_params``, or None if they
        lack one (vLLM then prefills locally)."""
        block_ids = params.get("remote_block_ids") or []
        if isinstance(block_ids, list) and all(isinstance(b, int) for b in block_ids):
            block_ids = [block_ids]  # Before per-group block ids.
        try:
            source = cls(
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                engine_id=str(params["remote_engine_id"]),
                request_id=str(params["remote_request_id"]),
                block_ids=[[int(b) for b in group] for group in block_ids],
            )
        except (KeyError, TypeError, ValueError):
            return None
        if not source.block_ids or not all(source.block_ids):
            return None
        return source


@dataclass
class RequestOutput:
    """What one engine step added to a request: new tokens and their text,
    and, on the last output, how it finished."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Per token of ``token_ids``, with ``SamplingOptions.logprobs``: its log
    # probability first, then the likeliest others' (with
    # ``SamplingOptions.logprob_token_ids``: then the requested tokens').
    logprobs: list[list[TokenLogprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class EngineRequest:
    """One sequence in the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    kv_transfer_params: dict[str, Any] | None = None
    # Other ids the request answers to (abort): the caller's X-Request-Id,
    # the API's response id.
    aliases: tuple[str, ...] = ()
    # Mixed into every pick (0: none), so that the choices of one prompt
    # differ as sampled ones would; a pick stays a function of the KV.
    seed: int = 0
    # Set by the engine.
    is_producer: bool = False
    remote: RemoteSource | None = None
    load_started: bool = False
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # Per token, the hash of it and every token before it (the model's KV seed).
    prefix_hashes: list[int] = field(default_factory=list)
    # The model's digest of the KV read so far, and of how many tokens.
    digest: int = 0
    num_digested: int = 0
    outputs: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    _text: str = ""
    _sent_text_len: int = 0

    # engine_patch.host.Request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        """No hashes: engine_patch reads them only for loads of offloaded KV,
        and the fake engine offloads nothing (``_PDConnector``)."""
        return []

    def get_finished_reason(self) -> int | None:
        return self.finish_reason

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    # Detokenising and stop conditions.

    def append_token(
        self, token_id: int, max_model_len: int
    ) -> tuple[FinishReason | None, int | str | None]:
        """Add a generated token; returns why the request finishes with it
        (and the stop reason), if it does."""
        self.output_token_ids.append(token_id)
        previous_len = len(self._text)
        sampling = self.sampling
        num_output = len(self.output_token_ids)
        stopped: tuple[FinishReason, int | None] | None = None
        if num_output > sampling.min_tokens:
            if token_id == EOS_TOKEN_ID and not sampling.ignore_eos:
                stopped = FinishReason.STOP, None
            elif token_id in sampling.stop_token_ids:
                stopped = FinishReason.STOP, token_id
        # As vLLM's detokenizer: a stop token's text only where asked.
        if stopped is None or sampling.include_stop_str_in_output:
            skip = sampling.skip_special_tokens
            self._text += decode([token_id], skip_special_tokens=skip)
        if stopped is not None:
            return stopped
        if num_output > sampling.min_tokens:
            for stop in sampling.stop:
                index = self._text.find(stop, max(0, previous_len - len(stop) + 1))
                if index >= 0:
                    keep = sampling.include_stop_str_in_output
                    end = index + len(stop) if keep else index
                    self._text = self._text[:end]
                    return FinishReason.STOP, stop
        if num_output >= sampling.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def take_text(self, finished: bool) -> str:
        """Text not yet output; all of it once finished, else all but what
        could still become a stop string (vLLM holds it back too)."""
        hold = 0
        if not finished and self.sampling.stop:
            hold = max(len(stop) for stop in self.sampling.stop) - 1
        end = max(self._sent_text_len, len(self._text) - hold)
        text = self._text[self._sent_text_len : end]
        self._sent_text_len = end
        return text

    @property
    def text(self) -> str:
        return self._text
