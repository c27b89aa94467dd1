"""One client request through prefill and decode, with retries before the first byte.

An attempt is a prefill on one instance and a decode on another. A decode
that fails before its first data (5xx, connection error, error event, empty
stream, first-token timeout) after a good prefill is retried on another
prefill (and another decode where one exists); once a byte has gone to the
client nothing is retried and a failure ends the stream with an error event.
A 4xx from either leg goes back to the client unchanged. A request that
fails alike on two instances (its content, not the instances, is at fault)
fails at once and counts against neither.

``Flow._attempt`` is one attempt from top to bottom; each leg returns a typed
result (``Prefilled``, ``FirstData``, ``Answer``, ``Passthrough`` or a
``Failure``) and records what it saw on the ``Attempt``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import hdrs, web

from proxy.assemble import Assembler
from proxy.auth import bearer
from proxy.body import (
    BadRequest,
    ClientRequest,
    Route,
    check_decode_fields,
    computed_alone,
    decode_body,
    kv_params_of,
    parse_request,
    prefill_body,
    prefix_key,
    remote_request_id,
    returns_token_ids,
    several_requests,
    stream_body,
    streams_alike,
)
from proxy.errors import error_event, error_response
from proxy.idle import IdleTimeout
from proxy.instances import Instance, ModelPools, short_contexts
from proxy.protocol import DONE_EVENT, INTEGRITY_MARKER
from proxy.sse import DONE, EventReader, First, FirstEventScanner, error_of
from proxy.upstream import ReplyTooLarge, UpstreamResponse, read_capped

if TYPE_CHECKING:
    from proxy.config import ProxyConfig
    from proxy.state import ProxyState

log = logging.getLogger("kvguard.proxy")
attempt_log = logging.getLogger("kvguard.proxy.attempts")

_MARKER_BYTES = INTEGRITY_MARKER.encode()

_encode_json = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode
_MAX_ERROR_BODY = 64 * 1024


class _TooLarge(Exception):
    pass


# ------------------------------------------------------------ leg results


@dataclass(slots=True)
class Failure:
    """Why an attempt failed before the client's first byte; it may be retried.

    ``answered`` failures are ones the instance answered (a 5xx, an error
    event, an empty or oversized reply), and a leg's timeout may be the
    request's own doing too (a prompt no prefill finishes within
    ``prefill_s``): both count against ``instance`` only once another
    attempt has served the request (see ``Flow._settle``). Connection
    failures say something about the instance and count at once.
    """

    reason: str  # metric label: kv_integrity, decode_5xx, prefill_connect, ...
    message: str
    role: str  # the leg that failed: "prefill" or "decode"
    answered: bool = False
    # The instance it counts against if another attempt serves the request;
    # None when it counted at once, or counts against nothing.
    instance: Instance | None = None
    prefill: Instance | None = None  # a decode's prefill (its KV's source)
    status: int = 502  # what the client gets if the request itself is at fault


@dataclass(slots=True, frozen=True)
class Prefilled:
    """A prefill that answered 2xx: its raw ``kv_transfer_params``, None if absent."""

    kv_params: bytes | None


@dataclass(slots=True, frozen=True)
class Passthrough:
    """A backend's 4xx from either leg, relayed to the client unchanged."""

    response: web.Response


@dataclass(slots=True, frozen=True)
class FirstData:
    """A decode stream whose first event carries data: the KV loaded.

    ``held`` is what was read up to that event; nothing has reached the client.
    """

    resp: UpstreamResponse
    held: bytes


@dataclass(slots=True, frozen=True)
class Answer:
    """The client's answer (sent, for a stream); ``outcome`` is the request's."""

    response: web.StreamResponse
    outcome: str = "ok"  # ok, or for a stream: client_disconnected, stream_error


@dataclass(slots=True, frozen=True)
class _StreamEnd:
    """How a relayed stream ended once the client had its first byte."""

    done: bool  # the decode sent [DONE] (held back: an error must precede it)
    error: str | None  # why the stream is cut short, None when it is whole
    expired: bool = False  # cut short by the request's total timeout


# ------------------------------------------------------- request, attempt


@dataclass(slots=True)
class _Request:
    """What every attempt of one client request shares."""

    http: web.Request
    route: Route
    body: ClientRequest
    pools: ModelPools
    request_id: str  # the client's X-Request-Id, or backend_id when it sent none
    backend_id: str  # the proxy's own id, the base of every attempt's id
    config: ProxyConfig
    started: float
    deadline: float
    key: bytes = b""
    prefill_body: bytes = b""
    # The decode's body before the prefill's params: the client's, or for a
    # non-streaming request decoded as a stream, ``stream_body``'s.
    decode_raw: bytes = b""
    assemble: bool = False  # a stream decoded for a non-streaming client
    # Every attempt's decode prefills locally (no prefill leg): vLLM runs
    # the request as several (n > 1, several prompts), or reads no KV it
    # did not compute for it (prompt logprobs, beam search).
    local_prefill: bool = False
    # Decodes whose context is known too short for the output budget: tried
    # last, as if they had failed already.
    short_decodes: frozenset[Instance] = frozenset()
    outcome: str | None = None
    # Failures that count against their ``instance`` only if the request is served.
    unsettled: list[Failure] = field(default_factory=list)
    # The instances of the attempt that answered the client in full, empty
    # until one has: the request itself can be served.
    served_by: tuple[Instance, ...] = ()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        """The total timeout has run out: a leg that timed out then says
        nothing about its instance."""
        return time.monotonic() >= self.deadline

    def loop_deadline(self) -> float:
        """``deadline`` in the running loop's ``time()`` (``IdleTimeout``'s)."""
        return asyncio.get_running_loop().time() + self.remaining()


@dataclass(slots=True)
class Attempt:
    """One try at a request: a prefill on one instance, a decode on another.

    The legs fill in what they saw; ``record`` turns it into the attempt's
    log line. ``prefill`` is None where the decode prefills locally: the
    decode-only fallback, and every attempt of a request vLLM runs as
    several or computes prompt logprobs for (``_Request.local_prefill``).
    The decode loads KV exactly when ``kv_params`` is set.
    """

    id: str  # the X-Request-Id both legs get: the request's backend_id + suffix
    number: int | None  # 0 for the first attempt; None for the decode-only one
    prefill: Instance | None
    decode: Instance
    ts: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    prefilled: bool = False  # the prefill answered 2xx
    kv_params: bytes | None = None  # the prefill's raw kv_transfer_params
    prefill_ms: float | None = None
    status: int | None = None  # the last leg's HTTP status
    error: str | None = None
    outcome: str = "cancelled"  # until a leg's result says otherwise

    @property
    def loads_kv(self) -> bool:
        """The decode loads the prefill's KV (else it prefills locally)."""
        return self.kv_params is not None

    def record(self, req: _Request) -> dict[str, Any]:
        """The attempt's log record (also what /status shows of a failure)."""
        entry: dict[str, Any] = {
            "ts": round(self.ts, 3),
            "request_id": req.request_id,
            "attempt": self.number,
            "attempt_id": self.id,
            "route": req.route.label,
            "model": req.body.model,
            "stream": req.body.stream,
            "prefill": None if self.prefill is None else self.prefill.url,
            "decode": self.decode.url,
        }
        if self.prefill_ms is not None:
            entry["prefill_ms"] = self.prefill_ms
        if self.prefilled:
            entry["kv_params"] = self.kv_params is not None
        if self.status is not None:
            entry["status"] = self.status
        if self.error is not None:
            entry["error"] = self.error
        entry["outcome"] = self.outcome
        entry["total_ms"] = round((time.monotonic() - self.started) * 1000, 2)
        return entry


def _passthrough(
    status: int, body: bytes, content_type: str, request_id: str
) -> Passthrough:
    """A backend's 4xx, relayed unchanged."""
    return Passthrough(
        web.Response(
            status=status,
            body=body,
            headers={"Content-Type": content_type, "X-Request-Id": request_id},
        )
    )


# What writing to a client that has gone raises.
_CLIENT_GONE = (ConnectionError, aiohttp.ClientConnectionResetError)


async def _write(
    out: web.StreamResponse,
    data: bytes,
    *,
    prepare: web.Request | None = None,
    eof: bool = False,
) -> bool:
    """Sends ``data`` to the client (after the headers, with ``prepare``).

    Returns False when the client has gone; ``eof`` ends the body in the
    same write.
    """
    try:
        if prepare is not None:
            await out.prepare(prepare)
        if eof:
            await out.write_eof(data)
        elif data:
            await out.write(data)
    except _CLIENT_GONE:
        return False
    return True


class Flow:
    """Serves POST /v1/completions and /v1/chat/completions."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    # ----------------------------------------------------------------- entry

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, Route.COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, Route.CHAT)

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        """Checks the request, then runs attempts until one answers.

        Only a request whose body has arrived counts against
        ``limits.max_in_flight``: a client that never sends its body holds
        its own connection until ``timeouts.request_body_s``, nothing more.
        """
        st = self.state
        cfg = st.config
        metrics = st.metrics
        started = time.monotonic()
        label = route.label
        # Backends never see the client's id: an id a client chose could name
        # another client's request in an abort, or in vLLM's error matching.
        backend_id = _new_request_id()
        request_id = _client_request_id(request.headers) or backend_id
        if st.auth.clients.required and not st.auth.clients.accepts(
            bearer(request.headers)
        ):
            metrics.count_request(label, "unauthorized")
            return error_response(401, "Invalid or missing API key", request_id)
        # A body that came whole with the head is read without a wait: no timer.
        body_s = None if request.content.is_eof() else cfg.timeouts.request_body_s
        try:
            async with asyncio.timeout(body_s):
                raw = await self._read_body(request, cfg.limits.max_body_bytes)
        except _TooLarge:
            metrics.count_request(label, "too_large")
            return error_response(
                413,
                f"Request body exceeds {cfg.limits.max_body_bytes} bytes",
                request_id,
            )
        except web.RequestPayloadError:
            metrics.count_request(label, "bad_request")
            resp = error_response(400, "Request body could not be decoded", request_id)
            resp.force_close()
            return resp
        except TimeoutError:
            metrics.count_request(label, "body_timeout")
            resp = error_response(
                408,
                f"Request body not received within {cfg.timeouts.request_body_s:g}s",
                request_id,
            )
            resp.force_close()
            return resp
        if st.in_flight >= cfg.limits.max_in_flight:
            metrics.count_request(label, "rejected")
            return error_response(
                429,
                f"Too many requests in flight (limit {cfg.limits.max_in_flight})",
                request_id,
            )
        st.in_flight += 1
        try:
            try:
                body = parse_request(raw, route)
            except BadRequest as exc:
                metrics.count_request(label, "bad_request")
                return error_response(400, exc.message, request_id, exc.param)
            pools = st.pools_for(body.model)
            if pools is None:
                metrics.count_request(label, "unknown_model")
                return error_response(
                    404,
                    f"The model `{body.model}` does not exist.",
                    request_id,
                    "model",
                )
            req = _Request(
                http=request,
                route=route,
                body=body,
                pools=pools,
                request_id=request_id,
                backend_id=backend_id,
                config=cfg,
                started=started,
                deadline=started + cfg.timeouts.total_s,
            )
            try:
                self._prepare(req)
            except BadRequest as exc:
                metrics.count_request(label, "bad_request")
                return error_response(400, exc.message, request_id, exc.param)
            return await self._serve(req)
        finally:
            st.in_flight -= 1

    @staticmethod
    async def _read_body(request: web.Request, limit: int) -> bytes:
        """The request's body, at most ``limit`` bytes as the flow reads it.

        A compressed body (``Content-Encoding``) is counted as aiohttp
        inflates it, not by its ``Content-Length``.

        Raises:
            _TooLarge: the body is over ``limit``.
            web.RequestPayloadError: the body does not decode (bad gzip).
        """
        length = request.content_length
        if length is not None and length > limit:
            raise _TooLarge
        if length is not None and hdrs.CONTENT_ENCODING not in request.headers:
            return await request.read()
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise _TooLarge
        return bytes(buf)

    @staticmethod
    def _prepare(req: _Request) -> None:
        """Builds what every attempt sends: the prefill body, the routing key.

        Raises:
            BadRequest: a field only the decode reads has a value vLLM
                refuses, or the body cannot be re-encoded (nested too deeply).
        """
        cfg = req.config
        pools = req.pools
        budget = check_decode_fields(req.body, req.route)
        if budget.tokens is not None:
            short, longest = short_contexts(pools.decode, req.body.model, budget.tokens)
            if longest is not None:
                # vLLM's own words (TokenizeParams), as its decode would answer.
                raise BadRequest(
                    f"{budget.param}={budget.tokens} cannot be greater than "
                    f"max_model_len={longest}. Please request fewer output tokens.",
                    budget.param,
                )
            req.short_decodes = short
        if (
            pools.prefill.policy == "prefix_hash"
            or pools.decode.policy == "prefix_hash"
        ):
            req.key = prefix_key(req.body, req.route, cfg.routing.prefix_hash_bytes)
        alone = computed_alone(req.body, req.route)
        req.local_prefill = alone or several_requests(req.body, req.route)
        if not req.local_prefill:
            req.prefill_body = prefill_body(req.body)
        req.decode_raw = req.body.raw
        if (
            not req.body.stream
            and cfg.retry.non_stream_as_stream
            and not alone
            and streams_alike(req.body)
        ):
            req.assemble = True
            req.decode_raw = stream_body(req.body, cfg.retry.non_stream_interval)

    # -------------------------------------------------------------- attempts

    async def _serve(self, req: _Request) -> web.StreamResponse:
        """Runs attempts until one answers, then settles the instances' health.

        A request that fails alike on two instances (same leg, same reason;
        for a decode, with different prefills too) is at fault itself: it
        fails at once, for its client only. Answered failures and leg
        timeouts count against their instances only if another attempt
        served the request.
        """
        try:
            return await self._attempts(req)
        finally:
            self._settle(req)

    def _settle(self, req: _Request) -> None:
        """Counts the request's unsettled failures, once per instance, if an
        attempt served it: one no instance served (a single decode, or two
        sharing its prefill; a prompt too slow for any) may be at fault
        itself. The instances that served it are not counted for it."""
        if not req.served_by:
            return
        counted = set(req.served_by)
        for failure in req.unsettled:
            inst = failure.instance
            if inst is not None and inst not in counted:
                counted.add(inst)
                self.state.health.note(inst, ok=False)

    @staticmethod
    def _failed_alike(req: _Request, failure: Failure) -> bool:
        """``failure`` repeats an earlier one of ``req`` on other instances
        (for a decode's, not with KV from the same prefill: a local prefill's
        shares none)."""
        return any(
            f.role == failure.role
            and f.reason == failure.reason
            and f.instance is not failure.instance
            and (
                f.role == "prefill"
                or f.prefill is None
                or f.prefill is not failure.prefill
            )
            for f in req.unsettled
        )

    async def _attempts(self, req: _Request) -> web.StreamResponse:
        st = self.state
        cfg = req.config
        pools = req.pools
        probing = cfg.health.enabled
        avoid_p: set[Instance] = set()
        avoid_d: set[Instance] = set(req.short_decodes)
        failure: Failure | None = None
        reason = "no attempt was made"
        try:
            for number in range(cfg.retry.max_attempts):
                if failure is not None:
                    if req.expired():
                        break
                    await asyncio.sleep(
                        min(self._backoff(number, cfg), req.remaining())
                    )
                    if req.expired():
                        break
                prefill = None
                if not req.local_prefill:
                    prefill = st.router.pick(
                        pools.prefill,
                        req.key,
                        avoid_p,
                        probing=probing,
                        partners=pools.decode,
                    )
                    if prefill is None:
                        reason = "no healthy prefill instance"
                        break
                decode = st.router.pick(
                    pools.decode, req.key, avoid_d, partner=prefill, probing=probing
                )
                if decode is None:
                    reason = "no healthy decode instance"
                    break
                if failure is not None:  # counted once it is really made
                    st.metrics.retries.labels(failure.reason).inc()
                attempt_id = (
                    req.backend_id if number == 0 else f"{req.backend_id}-retry{number}"
                )
                result = await self._attempt(
                    req, Attempt(attempt_id, number, prefill, decode)
                )
                if not isinstance(result, Failure):
                    return result
                if result.answered and self._failed_alike(req, result):
                    self._finish(req, "request_error")
                    return error_response(
                        result.status,
                        f"The request failed the same way on two {result.role} "
                        f"instances: {result.message}",
                        req.request_id,
                    )
                if result.instance is not None:
                    req.unsettled.append(result)
                failure = result
                reason = f"{result.role} failed: {result.message}"
                if prefill is not None:
                    avoid_p.add(prefill)
                if result.role == "decode":
                    avoid_d.add(decode)
            # A total-timeout failure is made only once the deadline has passed.
            expired = req.expired()
            # Attempts that prefilled locally already were the fallback.
            fallback = cfg.retry.on_exhausted == "decode_only"
            if fallback and not req.local_prefill and not expired:
                result = await self._decode_only(req, avoid_d, failure)
                if not isinstance(result, Failure):
                    return result
                if result.instance is not None:
                    req.unsettled.append(result)
                reason = f"decode-only fallback failed: {result.message}"
                expired = result.reason == _TOTAL_TIMEOUT
        except asyncio.CancelledError:
            self._finish(req, "client_disconnected")
            raise
        if expired:
            self._finish(req, "timeout")
            return error_response(
                504, "The request exceeded its total timeout", req.request_id
            )
        self._finish(req, "failed")
        return error_response(
            503, f"No instance could serve the request: {reason}", req.request_id
        )

    @staticmethod
    def _backoff(attempt: int, cfg: ProxyConfig) -> float:
        """Equal-jitter exponential backoff before attempt number ``attempt``."""
        ceiling = min(
            cfg.retry.backoff_max_s, cfg.retry.backoff_base_s * 2 ** (attempt - 1)
        )
        return random.uniform(ceiling / 2, ceiling)

    async def _decode_only(
        self, req: _Request, avoid: set[Instance], after: Failure | None
    ) -> web.StreamResponse | Failure:
        """Retries exhausted: the original body to a decode, which prefills
        locally; one not tried yet when there is one."""
        decode = self.state.router.pick(
            req.pools.decode, req.key, avoid, probing=req.config.health.enabled
        )
        if decode is None:
            return Failure("no_decode", "no healthy decode instance", "decode")
        if after is not None:
            self.state.metrics.retries.labels(after.reason).inc()
        attempt = Attempt(f"{req.backend_id}-decode-only", None, None, decode)
        return await self._attempt(req, attempt)

    # ------------------------------------------------------------ one attempt

    async def _attempt(
        self, req: _Request, attempt: Attempt
    ) -> web.StreamResponse | Failure:
        """One attempt: prefill, decode to its first data, then answer the client.

        Whenever the decode does not pull the prefill's KV (it failed, a 4xx,
        the client left), the prefill is asked to free it.
        """
        decode = attempt.decode
        # Reserved from now, prefill included: a burst of requests whose
        # prefills are running must not all pick the same idle decode.
        decode.in_flight += 1
        try:
            if attempt.prefill is not None:
                prefilled = await self._prefill(req, attempt)
                attempt.prefill_ms = round(
                    (time.monotonic() - attempt.started) * 1000, 2
                )
                if not isinstance(prefilled, Prefilled):
                    return self._result(req, attempt, prefilled)
                attempt.prefilled = True
                attempt.kv_params = prefilled.kv_params
            result: Answer | Passthrough | Failure
            pulled = False
            try:
                remaining = req.remaining()
                if remaining <= 0:
                    result = _total_timeout("decode")
                elif not (req.body.stream or req.assemble):
                    result = await self._decode_json(req, attempt, remaining)
                    if isinstance(result, Answer):
                        self._decoded(req, attempt)
                else:
                    first = await self._decode_first(req, attempt, remaining)
                    if isinstance(first, FirstData):
                        self._decoded(req, attempt)
                        if req.assemble:
                            result = await self._collect(req, attempt, first)
                        else:
                            result = await self._relay(req, attempt, first)
                    else:
                        result = first
                pulled = isinstance(result, Answer)
            finally:
                if not pulled and attempt.prefill is not None and attempt.loads_kv:
                    self._abort(attempt.prefill, attempt.id, attempt.kv_params)
            if isinstance(result, Answer) and result.outcome == "ok":
                # Only a whole answer vouches for the decode: a stream that
                # breaks after its first token must count against it.
                self.state.health.note(decode, ok=True)
                req.served_by = (
                    (attempt.decode,)
                    if attempt.prefill is None
                    else (attempt.prefill, attempt.decode)
                )
            return self._result(req, attempt, result)
        finally:
            decode.in_flight -= 1
            self._log(attempt, req)

    def _result(
        self, req: _Request, attempt: Attempt, result: Answer | Passthrough | Failure
    ) -> web.StreamResponse | Failure:
        """Notes how a leg ended the attempt; the client's response or a Failure."""
        if isinstance(result, Failure):
            attempt.outcome = result.reason
            attempt.error = result.message
            return result
        if isinstance(result, Passthrough):
            from_prefill = attempt.prefill is not None and not attempt.prefilled
            attempt.outcome = "prefill_4xx" if from_prefill else "decode_4xx"
            attempt.status = result.response.status
            self._finish(req, "upstream_4xx")
            return result.response
        # The decode-only fallback's log says so, whatever the stream did.
        attempt.outcome = "decode_only" if attempt.number is None else result.outcome
        self._finish(req, result.outcome)
        return result.response

    def _log(self, attempt: Attempt, req: _Request) -> None:
        """Logs the attempt; keeps a prefill's integrity failure for /status."""
        keep = attempt.outcome == "kv_integrity" and attempt.prefill is not None
        logging_on = self.state.config.logging.attempts and attempt_log.isEnabledFor(
            logging.INFO
        )
        if not (keep or logging_on):
            return
        entry = attempt.record(req)
        if keep:
            self.state.recent_failures.append(entry)
        if logging_on:
            attempt_log.info("%s", _encode_json(entry).decode())

    def _decoded(self, req: _Request, attempt: Attempt) -> None:
        """The decode gave data: any KV it loaded was clean (its health is
        noted once its answer is whole)."""
        if attempt.prefill is not None and attempt.loads_kv:
            for ejection in self.state.tracker.record_success(
                attempt.prefill, attempt.decode
            ):
                self.state.on_ejection(ejection)

    # ---------------------------------------------------------------- prefill

    async def _prefill(
        self, req: _Request, attempt: Attempt
    ) -> Prefilled | Passthrough | Failure:
        """The prefill leg: its ``kv_transfer_params``, a 4xx, or a Failure."""
        st = self.state
        prefill = attempt.prefill
        assert prefill is not None
        timeout = st.prefill_timeout
        remaining = req.remaining()
        if remaining < req.config.timeouts.prefill_s:
            if remaining <= 0:
                return _total_timeout("prefill")
            timeout = aiohttp.ClientTimeout(
                total=remaining, sock_connect=req.config.timeouts.connect_s
            )
        headers = {**prefill.headers, "X-Request-Id": attempt.id}
        started = time.monotonic()
        prefill.in_flight += 1
        try:
            async with await st.upstream.post(
                prefill.urls[req.route.value],
                req.prefill_body,
                headers,
                timeout,
                "prefill",
            ) as resp:
                status = resp.status
                body = await read_capped(resp, req.config.limits.max_reply_bytes)
                content_type = resp.headers.get("Content-Type", "application/json")
        except ReplyTooLarge as exc:
            return self._answered("prefill_reply_too_large", f"prefill {exc}", prefill)
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, TimeoutError) and req.expired():
                return self._leg_expired(prefill, attempt, "prefill")
            reason, message = _transport_failure("prefill", exc, timeout)
            if reason == "prefill_timeout":  # it may still be prefilling
                self._abort(prefill, attempt.id, None)
                return self._timed_out("prefill", message, prefill)
            st.health.note(prefill, ok=False)
            st.metrics.upstream_failures.labels("prefill", prefill.url, reason).inc()
            return Failure(reason, message, "prefill")
        except asyncio.CancelledError:
            self._abort(prefill, attempt.id, None)
            raise
        finally:
            prefill.in_flight -= 1
        st.metrics.leg_prefill.observe(time.monotonic() - started)
        if 400 <= status < 500:
            return _passthrough(status, body, content_type, req.request_id)
        if status >= 300:
            return self._answered(
                "prefill_5xx",
                f"HTTP {status}: {_snippet(body)}",
                prefill,
                status=status if status >= 500 else 502,
            )
        try:
            kv_params = kv_params_of(body)
        except ValueError as exc:
            return self._answered("prefill_bad_reply", str(exc), prefill)
        st.health.note(prefill, ok=True)
        if kv_params is None:
            self._without_kv(prefill)
        return Prefilled(kv_params)

    def _without_kv(self, prefill: Instance) -> None:
        """Counts a prefill answered without ``kv_transfer_params``: its
        decode prefills the prompt again. The first on an instance is
        logged: one whose every prefill does so has no KV connector."""
        self.state.metrics.prefills_without_kv.labels(prefill.url).inc()
        prefill.prefills_without_kv += 1
        if prefill.prefills_without_kv == 1:
            log.warning(
                "prefill %s answered without kv_transfer_params, so its decode "
                "prefills the prompt again; an instance whose every prefill "
                "does so runs without a KV connector as kv_producer or kv_both "
                "(logged once per instance, each counted in "
                "kvguard_proxy_prefills_without_kv_params_total)",
                prefill.url,
            )

    # ---------------------------------------------------------------- decode

    @staticmethod
    def _decode_request(
        attempt: Attempt, req: _Request
    ) -> tuple[bytes, dict[str, str]]:
        """The decode leg's body (with the prefill's params verbatim) and headers."""
        body = decode_body(req.decode_raw, attempt.kv_params)
        return body, {**attempt.decode.headers, "X-Request-Id": attempt.id}

    async def _decode_json(
        self, req: _Request, attempt: Attempt, remaining: float
    ) -> Answer | Passthrough | Failure:
        """A non-streaming decode, read whole (``retry.non_stream_as_stream`` off)."""
        st = self.state
        decode = attempt.decode
        body, headers = self._decode_request(attempt, req)
        timeout = aiohttp.ClientTimeout(
            total=remaining, sock_connect=req.config.timeouts.connect_s
        )
        started = time.monotonic()
        try:
            async with await st.upstream.post(
                decode.urls[req.route.value], body, headers, timeout, "decode"
            ) as resp:
                status = resp.status
                data = await read_capped(resp, req.config.limits.max_reply_bytes)
                content_type = resp.headers.get("Content-Type", "application/json")
        except ReplyTooLarge as exc:
            return self._answered(
                "decode_reply_too_large", f"decode {exc}", decode, attempt.prefill
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, TimeoutError) and req.expired():
                return self._leg_expired(decode, attempt, "decode")
            failure = self._decode_transport_failure(decode, exc, timeout)
            if failure.reason == "decode_timeout":  # it may still be decoding
                self._abort(decode, attempt.id, None)
            return failure
        except asyncio.CancelledError:
            self._abort(decode, attempt.id, None)
            raise
        st.metrics.leg_decode.observe(time.monotonic() - started)
        attempt.status = status
        if status >= 500 or status < 200 or 300 <= status < 400:
            return self._decode_error(attempt, status, data)
        if status >= 400:
            return _passthrough(status, data, content_type, req.request_id)
        st.metrics.ttft.labels(req.route.label).observe(time.monotonic() - req.started)
        return Answer(
            web.Response(
                body=data,
                headers={"Content-Type": content_type, "X-Request-Id": req.request_id},
            )
        )

    async def _decode_first(
        self, req: _Request, attempt: Attempt, remaining: float
    ) -> FirstData | Passthrough | Failure:
        """A decode stream up to its first event, within ``decode_first_token_s``."""
        st = self.state
        decode = attempt.decode
        body, headers = self._decode_request(attempt, req)
        first_token_s = min(req.config.timeouts.decode_first_token_s, remaining)
        started = time.monotonic()
        resp: UpstreamResponse | None = None
        scanner = FirstEventScanner()
        limit = req.config.limits.max_reply_bytes
        try:
            async with asyncio.timeout(first_token_s):
                resp = await st.upstream.post(
                    decode.urls[req.route.value],
                    body,
                    headers,
                    st.stream_timeout,
                    "decode",
                )
                attempt.status = resp.status
                if resp.status != 200:
                    data = await resp.content.read(_MAX_ERROR_BODY)
                    status = resp.status
                    content_type = resp.headers.get("Content-Type", "application/json")
                    resp.close()
                    if 400 <= status < 500:
                        return _passthrough(status, data, content_type, req.request_id)
                    return self._decode_error(attempt, status, data)
                verdict = None
                async for chunk in resp.content.iter_any():
                    verdict = scanner.feed(chunk)
                    if verdict is not None:
                        break
                    if scanner.size > limit:
                        # Held in memory until the first output: bounded as a reply.
                        resp.close()
                        self._abort(decode, attempt.id, None)
                        return self._answered(
                            "decode_reply_too_large",
                            f"decode stream exceeds {limit} bytes before its output",
                            decode,
                            attempt.prefill,
                        )
                if verdict is None:
                    verdict = scanner.at_eof()
        except (TimeoutError, aiohttp.ClientError) as exc:
            if resp is not None:
                resp.close()
            if isinstance(exc, TimeoutError) and req.expired():
                return self._leg_expired(decode, attempt, "decode")
            if isinstance(exc, TimeoutError) and not isinstance(
                exc, aiohttp.ClientError
            ):
                self._abort(decode, attempt.id, None)
                return self._timed_out(
                    "decode", f"no first token within {first_token_s:.3g}s", decode
                )
            return self._decode_transport_failure(decode, exc, st.stream_timeout)
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()
            self._abort(decode, attempt.id, None)
            raise
        assert resp is not None
        st.metrics.leg_decode.observe(time.monotonic() - started)
        if verdict.kind is First.DATA:
            return FirstData(resp, scanner.held)
        resp.close()
        if verdict.kind is First.ERROR:
            return self._decode_error(attempt, 200, verdict.message.encode())
        if verdict.kind is First.ABORTED:
            # As for a collected stream: an abort says something about the
            # instance, and the client has seen nothing yet.
            st.health.note(decode, ok=False)
            st.metrics.upstream_failures.labels(
                "decode", decode.url, "decode_aborted"
            ).inc()
            return Failure("decode_aborted", verdict.message, "decode")
        return self._answered("decode_empty", verdict.message, decode, attempt.prefill)

    async def _collect(
        self, req: _Request, attempt: Attempt, first: FirstData
    ) -> Answer | Failure:
        """Reads the rest of a stream into one JSON reply for a non-stream client.

        The client has seen nothing yet, so any failure (an error event, a
        stall past ``stream_idle_s``, a broken or oversized stream) is a
        Failure the flow may retry.
        """
        st = self.state
        cfg = req.config
        decode = attempt.decode
        resp = first.resp
        limit = cfg.limits.max_reply_bytes
        idle = cfg.timeouts.stream_idle_s
        reader = EventReader()
        reply = Assembler(prompt_token_ids=returns_token_ids(req.body))
        size = 0
        data = first.held  # then each read, until the stream ends
        done = False
        failure: Failure | None = None
        try:
            async with IdleTimeout(idle, req.loop_deadline()) as timer:
                while data:
                    size += len(data)
                    if size > limit:
                        failure = self._answered(
                            "decode_reply_too_large",
                            f"decode reply exceeds {limit} bytes",
                            decode,
                            attempt.prefill,
                        )
                        break
                    for event in reader.feed(data):
                        if event.strip() == DONE:
                            done = True
                            break
                        failure = self._stream_event(attempt, event, reply)
                        if failure is not None:
                            break
                    if done or failure is not None:
                        break
                    data = await resp.content.readany()
                    timer.touch()
        except TimeoutError:
            failure = (
                _total_timeout("decode")
                if req.expired()
                else self._timed_out(
                    "decode", f"decode stream idle for {idle:.3g}s", decode
                )
            )
        except aiohttp.ClientError as exc:
            failure = Failure(
                "decode_connect",
                f"decode stream broke: {exc.__class__.__name__}",
                "decode",
            )
        except asyncio.CancelledError:  # the client left
            self._abort(decode, attempt.id, None)
            raise
        finally:
            if failure is None and done:
                resp.release()
            else:
                resp.close()
        if failure is None and not done:
            failure = Failure(
                "decode_connect", "decode stream ended without [DONE]", "decode"
            )
        result = reply.result()
        if failure is None and any(
            c.get("finish_reason") == "abort" for c in result["choices"]
        ):
            failure = Failure(
                "decode_aborted", "decode aborted the request mid-stream", "decode"
            )
        if failure is not None:
            if failure.instance is None and failure.reason not in (
                "kv_integrity",
                _TOTAL_TIMEOUT,
            ):
                # A broken connection or an abort says something about the
                # instance: it counts now.
                st.health.note(decode, ok=False)
                st.metrics.upstream_failures.labels(
                    "decode", decode.url, failure.reason
                ).inc()
            if not done:
                self._abort(decode, attempt.id, None)
            return failure
        st.metrics.ttft.labels(req.route.label).observe(time.monotonic() - req.started)
        return Answer(
            web.Response(
                body=_encode_json(result),
                headers={
                    "Content-Type": "application/json",
                    "X-Request-Id": req.request_id,
                },
            )
        )

    async def _relay(self, req: _Request, attempt: Attempt, first: FirstData) -> Answer:
        """Sends the held first event, then relays; failures end the stream.

        The answer's outcome is ``ok``, ``stream_error`` (the stream is cut
        short by an error event) or ``client_disconnected``.
        """
        st = self.state
        decode = attempt.decode
        resp = first.resp
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": req.request_id,
            }
        )
        outcome = "client_disconnected"  # until the stream has ended
        try:
            if await _write(out, first.held, prepare=req.http):
                st.metrics.ttft.labels(req.route.label).observe(
                    time.monotonic() - req.started
                )
                end = await self._pump(req, resp, out, first.held)
                if end is not None:
                    last_event = DONE_EVENT if end.done else b""
                    outcome = "ok"
                    if end.error is not None:
                        outcome = "stream_error"
                        if not end.expired:  # the request's own deadline
                            st.health.note(decode, ok=False)
                            st.metrics.upstream_failures.labels(
                                "decode", decode.url, "stream_broken"
                            ).inc()
                        attempt.error = end.error
                        last_event = error_event(504 if end.expired else 502, end.error)
                    # The last event and the end of the chunked body in one write.
                    sent = await _write(out, last_event, eof=True)
                    if not sent and end.error is None:
                        outcome = "client_disconnected"
            return Answer(out, outcome)
        except asyncio.CancelledError:
            outcome = "client_disconnected"
            raise
        finally:
            if outcome != "ok" or not resp.content.at_eof():
                resp.close()
            else:
                resp.release()
            if outcome != "ok":  # the client left, or the stream was given up
                self._abort(decode, attempt.id, None)

    async def _pump(
        self,
        req: _Request,
        resp: UpstreamResponse,
        out: web.StreamResponse,
        held: bytes,
    ) -> _StreamEnd | None:
        """Relays the decode's chunks after ``held``; None once the client is gone.

        [DONE] is held back, for an error event must come before it.
        """
        idle = req.config.timeouts.stream_idle_s
        gap = self.state.metrics.gaps
        last = time.monotonic()
        # What came last, for markers a read boundary splits.
        tail = held[-_TAIL:]
        aborted = _upstream_aborted(held)
        content = resp.content
        error: str | None = None
        done = False
        try:
            async with IdleTimeout(idle, req.loop_deadline()) as timer:
                while True:
                    try:
                        chunk = await content.readany()
                    except aiohttp.ClientError as exc:
                        error = f"decode stream broke: {exc.__class__.__name__}"
                        break
                    if not chunk:
                        break
                    now = time.monotonic()
                    gap.observe(now - last)
                    last = now
                    if (b'"abort"' in chunk and _upstream_aborted(chunk)) or (
                        # A read that ended mid-event may have split the marker.
                        not tail.endswith(b"\n\n")
                        and _upstream_aborted(tail + chunk[:_TAIL])
                    ):
                        aborted = True
                    tail = (
                        chunk[-_TAIL:]
                        if len(chunk) >= _TAIL
                        else (tail + chunk)[-_TAIL:]
                    )
                    if chunk.endswith(DONE_EVENT):
                        chunk = chunk[: -len(DONE_EVENT)]
                        done = True
                    try:  # _write's, inline: this runs once per chunk
                        if chunk:
                            await out.write(chunk)
                    except _CLIENT_GONE:
                        return None
                    # After the write: a client slow to take it is not the
                    # decode's idleness.
                    timer.touch()
        except TimeoutError:
            if req.expired():
                return _StreamEnd(done, _TOTAL_TIMEOUT_MESSAGE, expired=True)
            error = f"decode stream idle for {idle:.3g}s"
        if error is None and aborted:
            error = "decode aborted the request mid-stream"
        if error is None and not done and not tail.rstrip().endswith(DONE):
            error = "decode stream ended without [DONE]"
        return _StreamEnd(done, error)

    # --------------------------------------------------------------- helpers

    def _stream_event(
        self, attempt: Attempt, data: bytes, reply: Assembler
    ) -> Failure | None:
        """Adds one data event of a collected stream to ``reply``, or fails."""
        try:
            chunk = _decode_json(data)
        except (msgspec.DecodeError, RecursionError):
            chunk = None
        if type(chunk) is not dict:
            return self._bad_reply(attempt, "decode stream event is not a JSON object")
        if (message := error_of(chunk)) is not None:
            return self._decode_error(attempt, 200, message.encode())
        try:
            reply.feed(chunk)
        except ValueError as exc:
            return self._bad_reply(attempt, f"decode stream event: {exc}")
        return None

    def _bad_reply(self, attempt: Attempt, message: str) -> Failure:
        """The decode answered something that is no reply: the attempt fails
        on it, as on an error status."""
        return self._answered(
            "decode_bad_reply", message, attempt.decode, attempt.prefill
        )

    def _decode_transport_failure(
        self, decode: Instance, exc: BaseException, timeout: aiohttp.ClientTimeout
    ) -> Failure:
        """A decode's connection failure, counted now, or its timeout (see
        ``_timed_out``)."""
        reason, message = _transport_failure("decode", exc, timeout)
        if reason == "decode_timeout":
            return self._timed_out("decode", message, decode)
        self.state.health.note(decode, ok=False)
        self.state.metrics.upstream_failures.labels("decode", decode.url, reason).inc()
        return Failure(reason, message, "decode")

    def _decode_error(self, attempt: Attempt, status: int, data: bytes) -> Failure:
        """Classifies a decode error before the first byte: integrity or not."""
        st = self.state
        prefill, decode = attempt.prefill, attempt.decode
        message = _snippet(data)
        if _MARKER_BYTES in data:
            if prefill is not None:
                st.metrics.integrity_failures.labels(prefill.url, decode.url).inc()
                for ejection in st.tracker.record_failure(prefill, decode):
                    st.on_ejection(ejection)
            return Failure("kv_integrity", message, "decode")
        reason = "decode_error_event" if status == 200 else "decode_5xx"
        prefix = "error event" if status == 200 else f"HTTP {status}"
        return self._answered(
            reason,
            f"{prefix}: {message}",
            decode,
            prefill,
            status=status if status >= 500 else 500,
        )

    def _answered(
        self,
        reason: str,
        message: str,
        instance: Instance,
        prefill: Instance | None = None,
        *,
        status: int = 502,
    ) -> Failure:
        """A failure ``instance`` answered (its leg: the role of ``reason``),
        counted in the upstream failures; against the instance only later
        (see :class:`Failure`). ``prefill`` is a decode's KV source."""
        role = "prefill" if reason.startswith("prefill") else "decode"
        self.state.metrics.upstream_failures.labels(role, instance.url, reason).inc()
        return Failure(
            reason,
            message,
            role,
            answered=True,
            instance=instance,
            prefill=prefill,
            status=status,
        )

    def _timed_out(self, role: str, message: str, instance: Instance) -> Failure:
        """A leg that timed out on ``instance``, counted in the upstream
        failures; against the instance only if another attempt serves the
        request (see :class:`Failure`): the request may be slow everywhere."""
        reason = f"{role}_timeout"
        self.state.metrics.upstream_failures.labels(role, instance.url, reason).inc()
        return Failure(reason, message, role, instance=instance)

    def _leg_expired(self, inst: Instance, attempt: Attempt, role: str) -> Failure:
        """A leg timed out because the request's total timeout ran out: it
        counts against nothing, and ``inst`` (still working on it, maybe) is
        asked to abort."""
        self._abort(inst, attempt.id, None)
        return _total_timeout(role)

    def _abort(self, inst: Instance, attempt_id: str, kv_params: bytes | None) -> None:
        """Asks ``inst`` (in the background) to abort the attempt and free its KV."""
        ids = [attempt_id]
        if kv_params is not None:
            internal = remote_request_id(kv_params)
            if internal and internal != attempt_id:
                ids.append(internal)
        self.state.spawn(self.state.abort(inst, ids))

    def _finish(self, req: _Request, outcome: str) -> None:
        """Counts the request's outcome and duration, once."""
        if req.outcome is not None:
            return
        req.outcome = outcome
        metrics = self.state.metrics
        metrics.count_request(req.route.label, outcome)
        metrics.e2e.labels(req.route.label).observe(time.monotonic() - req.started)


_TOTAL_TIMEOUT = "total_timeout"
_TOTAL_TIMEOUT_MESSAGE = "request exceeded its total timeout"
_ABORT_RE = re.compile(rb'"finish_reason"\s*:\s*"abort"')
_MAX_CLIENT_ID = 256
# Bytes of a stream kept across reads: twice the abort marker as vLLM writes it.
_TAIL = 48


def _total_timeout(role: str) -> Failure:
    """The failure of a leg that the request's total timeout cut short."""
    return Failure(_TOTAL_TIMEOUT, _TOTAL_TIMEOUT_MESSAGE, role)


def _client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``X-Request-Id`` when it is printable ASCII of at most
    ``_MAX_CLIENT_ID`` characters, else None (the proxy's own id is used):
    it is echoed in headers and logs, which take nothing else."""
    value = headers.get("X-Request-Id")
    if (
        value
        and len(value) <= _MAX_CLIENT_ID
        and value.isascii()
        and value.isprintable()
    ):
        return value
    return None


def _new_request_id() -> str:
    """32 random hex digits, as uuid4().hex but without its system call."""
    return f"{random.getrandbits(128):032x}"


def _upstream_aborted(chunk: bytes) -> bool:
    """A chunk finishing a choice with ``abort``: the decode dropped the request.

    The client is still connected (else the relay would have stopped), so
    the answer is cut short and must not look complete.
    """
    return b'"abort"' in chunk and _ABORT_RE.search(chunk) is not None


def _snippet(data: bytes, limit: int = 300) -> str:
    """A short, printable excerpt of an error body (its message when it has one)."""
    try:
        obj = msgspec.json.decode(data)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return str(obj["error"].get("message", obj["error"]))[:limit]
        if isinstance(obj, dict) and "message" in obj:
            return str(obj["message"])[:limit]
    except (msgspec.DecodeError, RecursionError):
        pass
    return data[:limit].decode("utf-8", "replace")


def _transport_failure(
    role: str, exc: BaseException, timeout: aiohttp.ClientTimeout
) -> tuple[str, str]:
    """(reason, message) for a connection error or timeout on one leg."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"{role}_connect", f"connect timed out after {timeout.sock_connect}s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"{role}_connect", f"cannot connect: {exc.os_error}"
    if isinstance(exc, TimeoutError):
        return f"{role}_timeout", f"no reply within {timeout.total}s"
    return f"{role}_connect", f"connection failed: {exc.__class__.__name__}: {exc}"
