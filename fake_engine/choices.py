"""A response's choices: the engine request behind each, its outputs joined
or merged with the others' as they come, what a stream has sent of it, and
the beams of a beam search."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from fake_engine.model import TokenLogprob
from fake_engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
)
from fake_engine.request import EngineRequest, RequestOutput
from fake_engine.tokenizer import EOS_TOKEN_ID, decode


def shows_nothing(out: RequestOutput, num_output: int, *, echoes: bool) -> bool:
    """Whether a stream skips ``out``: no text and no tokens while none were
    output yet (``num_output`` counts ``out``'s), and no echo to send. vLLM's
    stream generators skip such an output even when it finishes the request
    (one aborted before its first token): its stream then has no choice chunk."""
    return not out.text and num_output == 0 and not echoes


def joined(held: RequestOutput, out: RequestOutput) -> RequestOutput:
    """``out`` with the tokens and text of ``held``, an output not yet sent,
    before its own."""
    logprobs = None
    if held.logprobs is not None and out.logprobs is not None:
        logprobs = held.logprobs + out.logprobs
    return RequestOutput(
        held.token_ids + out.token_ids,
        held.text + out.text,
        out.finish_reason,
        out.stop_reason,
        out.error,
        out.kv_transfer_params,
        logprobs,
    )


@dataclasses.dataclass
class Choice:
    """One choice of a response: its engine request and its builder."""

    request: EngineRequest
    builder: ResponseBuilder


@dataclasses.dataclass
class Beam:
    """A beam of a beam search: its tokens, their summed logprob, and each
    token's position's logprobs."""

    token_ids: list[int]
    logprob: float
    logprobs: list[list[TokenLogprob]]
    finish_reason: str | None = None
    stop_reason: int | None = None

    def output(self, skip_special_tokens: bool) -> RequestOutput:
        """The beam as a finished request's last output (its text without a
        final EOS it keeps)."""
        text_ids = self.token_ids[: len(self.token_ids) - self.ends_in_eos]
        return RequestOutput(
            self.token_ids,
            decode(text_ids, skip_special_tokens=skip_special_tokens),
            self.finish_reason or "length",
            self.stop_reason,
            logprobs=self.logprobs,
        )

    @property
    def ends_in_eos(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] == EOS_TOKEN_ID

    def score(self, num_prompt: int, length_penalty: float) -> float:
        """vLLM's ``get_beam_search_score``: the logprob over the length
        (prompt included, a final EOS not), to the ``length_penalty``."""
        length = num_prompt + len(self.token_ids) - self.ends_in_eos
        return self.logprob / float(max(length, 1) ** length_penalty)


def grown(
    beams: list[Beam],
    outputs: list[RequestOutput],
    body: CompletionRequest | ChatCompletionRequest,
    done: list[Beam],
) -> list[Beam]:
    """Every beam grown by each of its step's logprobs' tokens, best first;
    those ending in EOS (unless ignored) go to ``done`` instead."""
    candidates = []
    for beam, out in zip(beams, outputs, strict=True):
        assert out.logprobs is not None
        (entries,) = out.logprobs
        for entry in entries:
            longer = Beam(
                [*beam.token_ids, entry.token_id],
                beam.logprob + entry.logprob,
                [*beam.logprobs, entries],
            )
            if entry.token_id == EOS_TOKEN_ID and not body.ignore_eos:
                longer.finish_reason, longer.stop_reason = "stop", EOS_TOKEN_ID
                if not body.include_stop_str_in_output:
                    longer.token_ids.pop()
                done.append(longer)
            else:
                candidates.append(longer)
    return sorted(candidates, key=lambda b: b.logprob, reverse=True)


@dataclasses.dataclass
class ChoiceStream:
    """What a stream has sent of one choice."""

    builder: ResponseBuilder
    first: bool = True
    num_output: int = 0
    held: RequestOutput | None = None
    # Where the next chunk's logprobs' text offsets start (completions).
    text_offset: int = 0

    def chunk(self, out: RequestOutput, interval: int) -> dict[str, Any] | None:
        """The chunk to send for ``out``, or None while it is held (or
        shows nothing)."""
        if self.held is not None:
            out = joined(self.held, out)
            self.held = None
        if (
            interval > 1
            and not out.finished
            and self.num_output > 0
            and len(out.token_ids) < interval
        ):
            self.held = out
            return None
        self.num_output += len(out.token_ids)
        builder = self.builder
        echoes = self.first and builder.echoes
        if shows_nothing(out, self.num_output, echoes=echoes):
            return None
        chunk = builder.chunk(
            text=out.text,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            token_ids=out.token_ids,
            first=self.first,
            num_output=self.num_output,
            logprobs=out.logprobs,
            text_offset=self.text_offset,
        )
        self.first = False
        logprobs = chunk["choices"][0]["logprobs"]
        if logprobs is not None and logprobs.get("tokens"):
            self.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return chunk


async def whole(request: EngineRequest) -> RequestOutput:
    """All of a request's outputs joined into one: its text, tokens and
    logprobs, and how it finished."""
    out = await request.outputs.get()
    while not out.finished:
        out = joined(out, await request.outputs.get())
    return out


async def merged(
    requests: list[EngineRequest],
) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Every request's outputs, each with its request's index, as they come
    (vLLM's ``merge_async_iterators``); a finished request's last."""
    if len(requests) == 1:
        (request,) = requests
        while True:
            out = await request.outputs.get()
            yield 0, out
            if out.finished:
                return
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def forward(index: int, request: EngineRequest) -> None:
        while True:
            out = await request.outputs.get()
            queue.put_nowait((index, out))
            if out.finished:
                return

    tasks = [asyncio.create_task(forward(i, r)) for i, r in enumerate(requests)]
    try:
        unfinished = len(requests)
        while unfinished:
            index, out = await queue.get()
            if out.finished:
                unfinished -= 1
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
