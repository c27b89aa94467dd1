"""One client request through prefill and decode, with retries before the first byte.

An attempt is a prefill on one instance and a decode on another. A decode
that fails before its first data (5xx, connection error, error event, empty
stream, first-token timeout) after a good prefill is retried on another
prefill (and another decode where one exists); once a byte has gone to the
client nothing is retried and a failure ends the stream with an error event.
A 4xx from either leg goes back to the client unchanged. A request that
fails alike on two instances (its content, not the instances, is at fault)
fails at once and counts against neither.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from proxy.assemble import Assembler
from proxy.auth import bearer
from proxy.body import (
    BadRequest,
    ClientRequest,
    Route,
    decode_body,
    kv_params_of,
    parse_request,
    prefill_body,
    prefix_key,
    remote_request_id,
    stream_body,
    streams_alike,
)
from proxy.errors import error_event, error_response
from proxy.instances import Instance, ModelPools
from proxy.sse import DONE, EventReader, First, FirstEventScanner, error_message
from proxy.upstream import ReplyTooLarge, read_capped

if TYPE_CHECKING:
    from proxy.app import ProxyState
    from proxy.config import ProxyConfig

log = logging.getLogger("kvguard.proxy")
attempt_log = logging.getLogger("kvguard.proxy.attempts")

# What KVGuard's engines (fake and vLLM plugin) put in a failed load's error.
INTEGRITY_MARKER = "KV checksum mismatch"
_MARKER_BYTES = INTEGRITY_MARKER.encode()

_encode_json = msgspec.json.Encoder().encode
_decode_json = msgspec.json.Decoder().decode
_MAX_ERROR_BODY = 64 * 1024


class _TooLarge(Exception):
    pass


@dataclass(slots=True)
class Failure:
    """Why an attempt failed before the client's first byte; it may be retried.

    ``answered`` failures are ones the instance answered (a 5xx, an error
    event, an empty or oversized reply): the request's own content may have
    caused them, so they count against ``instance`` only once the request is
    over and did not fail alike elsewhere (see ``Flow._serve``). Connection
    failures and timeouts say something about the instance and count at once.
    """

    reason: str  # metric label: kv_integrity, decode_5xx, prefill_connect, ...
    message: str
    role: str  # the leg that failed: "prefill" or "decode"
    answered: bool = False
    instance: Instance | None = None  # the instance that answered it
    prefill: Instance | None = None  # a decode's prefill (its KV's source)
    status: int = 502  # what the client gets if the request itself is at fault


@dataclass(slots=True)
class _Request:
    """What every attempt of one client request shares."""

    http: web.Request
    route: Route
    body: ClientRequest
    pools: ModelPools
    request_id: str
    config: ProxyConfig
    started: float
    deadline: float
    key: bytes = b""
    prefill_body: bytes = b""
    # The decode's body before the prefill's params: the client's, or for a
    # non-streaming request decoded as a stream, ``stream_body``'s.
    decode_raw: bytes = b""
    assemble: bool = False  # a stream decoded for a non-streaming client
    outcome: str | None = None
    answered: list[Failure] = field(default_factory=list)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _client_headers(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id}


def _passthrough(
    status: int, body: bytes, content_type: str, request_id: str
) -> web.Response:
    """A backend's 4xx, relayed unchanged."""
    return web.Response(
        status=status,
        body=body,
        headers={"Content-Type": content_type, "X-Request-Id": request_id},
    )


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
        request_id = request.headers.get("X-Request-Id") or _new_request_id()
        if st.auth.clients.required and not st.auth.clients.accepts(
            bearer(request.headers)
        ):
            metrics.count_request(label, "unauthorized")
            return error_response(401, "Invalid or missing API key", request_id)
        try:
            async with asyncio.timeout(cfg.timeouts.request_body_s):
                raw = await self._read_body(request, cfg.limits.max_body_bytes)
        except _TooLarge:
            metrics.count_request(label, "too_large")
            return error_response(
                413,
                f"Request body exceeds {cfg.limits.max_body_bytes} bytes",
                request_id,
            )
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
        length = request.content_length
        if length is not None:
            if length > limit:
                raise _TooLarge
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
            BadRequest: the body cannot be re-encoded (nested too deeply).
        """
        cfg = req.config
        pools = req.pools
        if (
            pools.prefill.policy == "prefix_hash"
            or pools.decode.policy == "prefix_hash"
        ):
            req.key = prefix_key(req.body, req.route, cfg.routing.prefix_hash_bytes)
        req.prefill_body = prefill_body(req.body)
        req.decode_raw = req.body.raw
        if (
            not req.body.stream
            and cfg.retry.non_stream_as_stream
            and streams_alike(req.body)
        ):
            req.assemble = True
            req.decode_raw = stream_body(req.body)

    # -------------------------------------------------------------- attempts

    async def _serve(self, req: _Request) -> web.StreamResponse:
        """Runs attempts until one answers, then settles the instances' health.

        A request that fails alike on two instances (same leg, same reason;
        for a decode, with different prefills too) is at fault itself: it
        fails at once, for its client only, and counts against no instance.
        """
        try:
            return await self._attempts(req)
        finally:
            self._settle(req)

    def _settle(self, req: _Request) -> None:
        """Counts the request's answered failures, once per instance."""
        if req.outcome == "request_error":
            return
        counted: set[Instance] = set()
        for failure in req.answered:
            inst = failure.instance
            if inst is not None and inst not in counted:
                counted.add(inst)
                self.state.health.note(inst, ok=False)

    @staticmethod
    def _failed_alike(req: _Request, failure: Failure) -> bool:
        """``failure`` repeats an earlier one of ``req`` on other instances."""
        return any(
            f.role == failure.role
            and f.reason == failure.reason
            and f.instance is not failure.instance
            and (f.role == "prefill" or f.prefill is not failure.prefill)
            for f in req.answered
        )

    async def _attempts(self, req: _Request) -> web.StreamResponse:
        st = self.state
        cfg = req.config
        pools = req.pools
        probing = cfg.health.enabled
        avoid_p: set[Instance] = set()
        avoid_d: set[Instance] = set()
        failure: Failure | None = None
        reason = "no attempt was made"
        try:
            for attempt in range(cfg.retry.max_attempts):
                if failure is not None:
                    st.metrics.retries.labels(failure.reason).inc()
                    await asyncio.sleep(self._backoff(attempt, cfg))
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
                attempt_id = (
                    req.request_id
                    if attempt == 0
                    else f"{req.request_id}-retry{attempt}"
                )
                result = await self._attempt(req, attempt, attempt_id, prefill, decode)
                if not isinstance(result, Failure):
                    return result
                if result.answered:
                    if self._failed_alike(req, result):
                        self._finish(req, "request_error")
                        return error_response(
                            result.status,
                            f"The request failed the same way on two {result.role} "
                            f"instances: {result.message}",
                            req.request_id,
                        )
                    req.answered.append(result)
                failure = result
                reason = f"{result.role} failed: {result.message}"
                avoid_p.add(prefill)
                if result.role == "decode":
                    avoid_d.add(decode)
            if cfg.retry.on_exhausted == "decode_only":
                if failure is not None:
                    st.metrics.retries.labels(failure.reason).inc()
                result = await self._decode_only(req)
                if not isinstance(result, Failure):
                    return result
                if result.answered:
                    req.answered.append(result)
                reason = f"decode-only fallback failed: {result.message}"
        except asyncio.CancelledError:
            self._finish(req, "client_disconnected")
            raise
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

    async def _attempt(
        self,
        req: _Request,
        attempt: int,
        attempt_id: str,
        prefill: Instance,
        decode: Instance,
    ) -> web.StreamResponse | Failure:
        """Prefill on ``prefill``, then decode on ``decode``."""
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "request_id": req.request_id,
            "attempt": attempt,
            "attempt_id": attempt_id,
            "route": req.route.label,
            "model": req.body.model,
            "stream": req.body.stream,
            "prefill": prefill.url,
            "decode": decode.url,
        }
        started = time.monotonic()
        outcome = "cancelled"
        try:
            result = await self._prefill(req, attempt_id, prefill)
            entry["prefill_ms"] = round((time.monotonic() - started) * 1000, 2)
            if isinstance(result, Failure):
                outcome = result.reason
                entry["error"] = result.message
                return result
            if isinstance(result, web.Response):
                outcome = "prefill_4xx"
                entry["status"] = result.status
                self._finish(req, "upstream_4xx")
                return result
            kv_params = result
            entry["kv_params"] = kv_params is not None
            answer = await self._decode(
                req, attempt_id, prefill, decode, kv_params, entry
            )
            if isinstance(answer, Failure):
                outcome = answer.reason
                entry["error"] = answer.message
            else:
                outcome = entry.pop("outcome", "ok")
            return answer
        finally:
            if outcome == "kv_integrity":
                self.state.recent_failures.append(entry)
            if self.state.config.logging.attempts and attempt_log.isEnabledFor(
                logging.INFO
            ):
                entry["outcome"] = outcome
                entry["total_ms"] = round((time.monotonic() - started) * 1000, 2)
                attempt_log.info("%s", _encode_json(entry).decode())

    async def _prefill(
        self, req: _Request, attempt_id: str, prefill: Instance
    ) -> bytes | web.Response | Failure | None:
        """The prefill leg: raw ``kv_transfer_params`` or None, a 4xx, or a Failure."""
        st = self.state
        timeout = st.prefill_timeout
        remaining = req.remaining()
        if remaining < req.config.timeouts.prefill_s:
            if remaining <= 0:
                return Failure("total_timeout", "total timeout exceeded", "prefill")
            timeout = aiohttp.ClientTimeout(
                total=remaining, sock_connect=req.config.timeouts.connect_s
            )
        headers = {**prefill.headers, "X-Request-Id": attempt_id}
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
            st.metrics.upstream_failures.labels(
                "prefill", prefill.url, "prefill_reply_too_large"
            ).inc()
            return Failure(
                "prefill_reply_too_large",
                f"prefill {exc}",
                "prefill",
                answered=True,
                instance=prefill,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason, message = _transport_failure("prefill", exc, timeout)
            st.health.note(prefill, ok=False)
            st.metrics.upstream_failures.labels("prefill", prefill.url, reason).inc()
            return Failure(reason, message, "prefill")
        finally:
            prefill.in_flight -= 1
        st.metrics.leg_prefill.observe(time.monotonic() - started)
        if 400 <= status < 500:
            return _passthrough(status, body, content_type, req.request_id)
        if status >= 300:
            st.metrics.upstream_failures.labels(
                "prefill", prefill.url, "prefill_5xx"
            ).inc()
            return Failure(
                "prefill_5xx",
                f"HTTP {status}: {_snippet(body)}",
                "prefill",
                answered=True,
                instance=prefill,
                status=status if status >= 500 else 502,
            )
        try:
            kv_params = kv_params_of(body)
        except msgspec.DecodeError:
            st.metrics.upstream_failures.labels(
                "prefill", prefill.url, "prefill_bad_reply"
            ).inc()
            return Failure(
                "prefill_bad_reply",
                "prefill reply is not a JSON object",
                "prefill",
                answered=True,
                instance=prefill,
            )
        st.health.note(prefill, ok=True)
        return kv_params

    async def _decode_only(self, req: _Request) -> web.StreamResponse | Failure:
        """Retries exhausted: the original body to a decode, which prefills locally."""
        decode = self.state.router.pick(
            req.pools.decode, req.key, probing=req.config.health.enabled
        )
        if decode is None:
            return Failure("no_decode", "no healthy decode instance", "decode")
        attempt_id = f"{req.request_id}-decode-only"
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "request_id": req.request_id,
            "attempt_id": attempt_id,
            "route": req.route.label,
            "prefill": None,
            "decode": decode.url,
        }
        started = time.monotonic()
        answer = await self._decode(req, attempt_id, None, decode, None, entry)
        if self.state.config.logging.attempts and attempt_log.isEnabledFor(
            logging.INFO
        ):
            entry["outcome"] = (
                answer.reason if isinstance(answer, Failure) else "decode_only"
            )
            entry["total_ms"] = round((time.monotonic() - started) * 1000, 2)
            attempt_log.info("%s", _encode_json(entry).decode())
        return answer

    # ---------------------------------------------------------------- decode

    async def _decode(
        self,
        req: _Request,
        attempt_id: str,
        prefill: Instance | None,
        decode: Instance,
        kv_params: bytes | None,
        entry: dict[str, Any],
    ) -> web.StreamResponse | Failure:
        """The decode leg; frees the prefill's held KV whenever it won't be pulled."""
        body = decode_body(req.decode_raw, kv_params)
        headers = {**decode.headers, "X-Request-Id": attempt_id}
        pulled = False  # True once the decode produced data: the KV was loaded
        decode.in_flight += 1
        try:
            remaining = req.remaining()
            if remaining <= 0:
                return Failure("total_timeout", "total timeout exceeded", "decode")
            streamed = req.body.stream or req.assemble
            leg = self._decode_stream if streamed else self._decode_json
            answer = await leg(
                req, attempt_id, prefill, decode, body, headers, remaining, entry
            )
            pulled = not isinstance(answer, Failure) and 200 <= answer.status < 300
            return answer
        finally:
            decode.in_flight -= 1
            if not pulled and prefill is not None and kv_params is not None:
                self._abort(prefill, attempt_id, kv_params)

    async def _decode_json(
        self,
        req: _Request,
        attempt_id: str,
        prefill: Instance | None,
        decode: Instance,
        body: bytes,
        headers: dict[str, str],
        remaining: float,
        entry: dict[str, Any],
    ) -> web.StreamResponse | Failure:
        st = self.state
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
            st.metrics.upstream_failures.labels(
                "decode", decode.url, "decode_reply_too_large"
            ).inc()
            return Failure(
                "decode_reply_too_large",
                f"decode {exc}",
                "decode",
                answered=True,
                instance=decode,
                prefill=prefill,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            return self._decode_transport_failure(decode, exc, timeout)
        st.metrics.leg_decode.observe(time.monotonic() - started)
        entry["status"] = status
        if status >= 500 or status < 200 or 300 <= status < 400:
            return self._decode_error(prefill, decode, status, data)
        if status >= 400:
            entry["outcome"] = "decode_4xx"
            self._finish(req, "upstream_4xx")
            return _passthrough(status, data, content_type, req.request_id)
        st.health.note(decode, ok=True)
        self._record_clean_load(prefill, decode, body is not req.decode_raw)
        ttft, _ = st.metrics.route_histograms(req.route.label)
        ttft.observe(time.monotonic() - req.started)
        self._finish(req, "ok")
        return web.Response(
            body=data,
            headers={"Content-Type": content_type, "X-Request-Id": req.request_id},
        )

    async def _decode_stream(
        self,
        req: _Request,
        attempt_id: str,
        prefill: Instance | None,
        decode: Instance,
        body: bytes,
        headers: dict[str, str],
        remaining: float,
        entry: dict[str, Any],
    ) -> web.StreamResponse | Failure:
        st = self.state
        cfg = req.config
        first_token_s = min(cfg.timeouts.decode_first_token_s, remaining)
        started = time.monotonic()
        resp: aiohttp.ClientResponse | None = None
        scanner = FirstEventScanner()
        try:
            async with asyncio.timeout(first_token_s):
                resp = await st.upstream.post(
                    decode.urls[req.route.value],
                    body,
                    headers,
                    st.stream_timeout,
                    "decode",
                )
                entry["status"] = resp.status
                if resp.status != 200:
                    data = await resp.content.read(_MAX_ERROR_BODY)
                    status = resp.status
                    content_type = resp.headers.get("Content-Type", "application/json")
                    resp.close()
                    if 400 <= status < 500:
                        entry["outcome"] = "decode_4xx"
                        self._finish(req, "upstream_4xx")
                        return _passthrough(status, data, content_type, req.request_id)
                    return self._decode_error(prefill, decode, status, data)
                verdict = None
                async for chunk in resp.content.iter_any():
                    verdict = scanner.feed(chunk)
                    if verdict is not None:
                        break
                if verdict is None:
                    verdict = scanner.at_eof()
        except (TimeoutError, aiohttp.ClientError) as exc:
            if resp is not None:
                resp.close()
            if isinstance(exc, TimeoutError) and not isinstance(
                exc, aiohttp.ClientError
            ):
                st.health.note(decode, ok=False)
                st.metrics.upstream_failures.labels(
                    "decode", decode.url, "decode_timeout"
                ).inc()
                self._abort(decode, attempt_id, None)
                return Failure(
                    "decode_timeout",
                    f"no first token within {first_token_s:.3g}s",
                    "decode",
                )
            return self._decode_transport_failure(decode, exc, st.stream_timeout)
        except asyncio.CancelledError:
            if resp is not None:
                resp.close()
            self._abort(decode, attempt_id, None)
            raise
        assert resp is not None
        st.metrics.leg_decode.observe(time.monotonic() - started)
        if verdict.kind is not First.DATA:
            resp.close()
            if verdict.kind is First.ERROR:
                return self._decode_error(
                    prefill, decode, 200, verdict.message.encode()
                )
            st.metrics.upstream_failures.labels(
                "decode", decode.url, "decode_empty"
            ).inc()
            return Failure(
                "decode_empty",
                verdict.message,
                "decode",
                answered=True,
                instance=decode,
                prefill=prefill,
            )
        st.health.note(decode, ok=True)
        self._record_clean_load(prefill, decode, body is not req.decode_raw)
        if req.assemble:
            return await self._collect(
                req, attempt_id, prefill, decode, resp, scanner.held, entry
            )
        return await self._relay(req, attempt_id, decode, resp, scanner.held, entry)

    async def _collect(
        self,
        req: _Request,
        attempt_id: str,
        prefill: Instance | None,
        decode: Instance,
        resp: aiohttp.ClientResponse,
        held: bytes,
        entry: dict[str, Any],
    ) -> web.StreamResponse | Failure:
        """Reads the rest of a stream into one JSON reply for a non-stream client.

        The client has seen nothing yet, so any failure (an error event, a
        stall past ``stream_idle_s``, a broken or oversized stream) is a
        Failure the flow may retry.
        """
        st = self.state
        cfg = req.config
        limit = cfg.limits.max_reply_bytes
        idle = cfg.timeouts.stream_idle_s
        loop = asyncio.get_running_loop()
        reader = EventReader()
        reply = Assembler()
        size = len(held)
        events = reader.feed(held)
        done = False
        failure: Failure | None = None
        try:
            now = time.monotonic()
            async with asyncio.timeout(min(idle, req.deadline - now)) as timer:
                while failure is None:
                    for data in events:
                        if data.strip() == DONE:
                            done = True
                            break
                        failure = self._stream_event(prefill, decode, data, reply)
                        if failure is not None:
                            break
                    if done or failure is not None:
                        break
                    data = await resp.content.readany()
                    if not data:
                        break
                    size += len(data)
                    if size > limit:
                        failure = Failure(
                            "decode_reply_too_large",
                            f"decode reply exceeds {limit} bytes",
                            "decode",
                            answered=True,
                            instance=decode,
                            prefill=prefill,
                        )
                        break
                    events = reader.feed(data)
                    now = time.monotonic()
                    timer.reschedule(loop.time() + min(idle, req.deadline - now))
        except TimeoutError:
            failure = Failure(
                "decode_timeout",
                "request exceeded its total timeout"
                if time.monotonic() >= req.deadline
                else f"decode stream idle for {idle:.3g}s",
                "decode",
            )
        except aiohttp.ClientError as exc:
            failure = Failure(
                "decode_connect",
                f"decode stream broke: {exc.__class__.__name__}",
                "decode",
            )
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
            if not failure.answered and failure.reason != "kv_integrity":
                # A broken connection, a stall or an abort says something
                # about the instance: it counts now.
                st.health.note(decode, ok=False)
                st.metrics.upstream_failures.labels(
                    "decode", decode.url, failure.reason
                ).inc()
            if not done:
                self._abort(decode, attempt_id, None)
            return failure
        entry["outcome"] = "ok"
        ttft, _ = st.metrics.route_histograms(req.route.label)
        ttft.observe(time.monotonic() - req.started)
        self._finish(req, "ok")
        return web.Response(
            body=_encode_json(result),
            headers={
                "Content-Type": "application/json",
                "X-Request-Id": req.request_id,
            },
        )

    async def _relay(
        self,
        req: _Request,
        attempt_id: str,
        decode: Instance,
        resp: aiohttp.ClientResponse,
        held: bytes,
        entry: dict[str, Any],
    ) -> web.StreamResponse:
        """Sends the held first event, then relays; failures end the stream."""
        st = self.state
        cfg = req.config
        metrics = st.metrics
        ttft, _ = metrics.route_histograms(req.route.label)
        loop = asyncio.get_running_loop()
        out = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": req.request_id,
            }
        )
        outcome = "ok"
        try:
            try:
                await out.prepare(req.http)
                await out.write(held)
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                outcome = "client_disconnected"
                return out
            now = time.monotonic()
            ttft.observe(now - req.started)
            idle = cfg.timeouts.stream_idle_s
            # The idle timer is moved only every ``slack`` seconds, not per
            # chunk: a gap of ``idle`` is still caught, at most ``slack`` late.
            slack = idle / 16
            gap = metrics.gaps
            last = armed = now
            tail = held[-16:]
            aborted = _upstream_aborted(held)
            content = resp.content
            error: str | None = None
            done = False
            try:
                async with asyncio.timeout(
                    min(now + idle + slack, req.deadline) - now
                ) as timer:
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
                        tail = chunk[-16:] if len(chunk) >= 16 else (tail + chunk)[-16:]
                        if b'"abort"' in chunk and _upstream_aborted(chunk):
                            aborted = True
                        # [DONE] is held back: an error event must come before it.
                        if chunk.endswith(_DONE_EVENT):
                            chunk = chunk[: -len(_DONE_EVENT)]
                            done = True
                        try:
                            if chunk:
                                await out.write(chunk)
                        except (ConnectionError, aiohttp.ClientConnectionResetError):
                            outcome = "client_disconnected"
                            return out
                        if now - armed >= slack:
                            armed = now
                            timer.reschedule(
                                loop.time() + min(idle + slack, req.deadline - now)
                            )
            except TimeoutError:
                error = (
                    "request exceeded its total timeout"
                    if time.monotonic() >= req.deadline
                    else f"decode stream idle for {idle:.3g}s"
                )
            if error is None and aborted:
                error = "decode aborted the request mid-stream"
            if error is None and not done and not tail.rstrip().endswith(DONE):
                error = "decode stream ended without [DONE]"
            last_event = _DONE_EVENT if done else b""
            if error is not None:
                outcome = "stream_error"
                st.health.note(decode, ok=False)
                metrics.upstream_failures.labels(
                    "decode", decode.url, "stream_broken"
                ).inc()
                entry["error"] = error
                last_event = error_event(502, error)
            try:
                # The last event and the end of the chunked body in one write.
                await out.write_eof(last_event)
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                if error is None:
                    outcome = "client_disconnected"
            return out
        except asyncio.CancelledError:
            outcome = "client_disconnected"
            raise
        finally:
            entry["outcome"] = outcome
            if outcome != "ok" or not resp.content.at_eof():
                resp.close()
            else:
                resp.release()
            if outcome == "client_disconnected":
                self._abort(decode, attempt_id, None)
            self._finish(req, outcome)

    # --------------------------------------------------------------- helpers

    def _stream_event(
        self,
        prefill: Instance | None,
        decode: Instance,
        data: bytes,
        reply: Assembler,
    ) -> Failure | None:
        """Adds one data event of a collected stream to ``reply``, or fails."""
        message = error_message(data)
        if message is not None:
            return self._decode_error(prefill, decode, 200, message.encode())
        try:
            chunk = _decode_json(data)
        except (msgspec.DecodeError, RecursionError):
            chunk = None
        if not isinstance(chunk, dict):
            self.state.metrics.upstream_failures.labels(
                "decode", decode.url, "decode_bad_reply"
            ).inc()
            return Failure(
                "decode_bad_reply",
                "decode stream event is not a JSON object",
                "decode",
                answered=True,
                instance=decode,
                prefill=prefill,
            )
        reply.feed(chunk)
        return None

    def _decode_transport_failure(
        self, decode: Instance, exc: BaseException, timeout: aiohttp.ClientTimeout
    ) -> Failure:
        reason, message = _transport_failure("decode", exc, timeout)
        self.state.health.note(decode, ok=False)
        self.state.metrics.upstream_failures.labels("decode", decode.url, reason).inc()
        return Failure(reason, message, "decode")

    def _decode_error(
        self, prefill: Instance | None, decode: Instance, status: int, data: bytes
    ) -> Failure:
        """Classifies a decode error before the first byte: integrity or not."""
        st = self.state
        message = _snippet(data)
        if _MARKER_BYTES in data:
            if prefill is not None:
                st.metrics.integrity_failures.labels(prefill.url, decode.url).inc()
                for ejection in st.tracker.record_failure(prefill, decode):
                    st.on_ejection(ejection)
            return Failure("kv_integrity", message, "decode")
        reason = "decode_error_event" if status == 200 else "decode_5xx"
        st.metrics.upstream_failures.labels("decode", decode.url, reason).inc()
        prefix = "error event" if status == 200 else f"HTTP {status}"
        return Failure(
            reason,
            f"{prefix}: {message}",
            "decode",
            answered=True,
            instance=decode,
            prefill=prefill,
            status=status if status >= 500 else 500,
        )

    def _record_clean_load(
        self, prefill: Instance | None, decode: Instance, loaded: bool
    ) -> None:
        if prefill is not None and loaded:
            for ejection in self.state.tracker.record_success(prefill, decode):
                self.state.on_ejection(ejection)

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
        _, e2e = metrics.route_histograms(req.route.label)
        e2e.observe(time.monotonic() - req.started)


_DONE_EVENT = b"data: [DONE]\n\n"
_ABORT_RE = re.compile(rb'"finish_reason"\s*:\s*"abort"')


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
