"""Instance health through the real code, in any order of events.

A Hypothesis state machine drives ``proxy.health`` as the proxy does: probe
rounds (``Health.check_all``, directly or as the loop ``Health.run`` runs
them, some with requests failing while the probes are out), first probes
of instances a reload brings back, passive outcomes reported as the flow
reports them (``Health.note`` at once, ``Flow._settle`` for a request's
answered failures), ejections and their cooldowns, admin drains and
removals, reloads changing the thresholds or turning checks off, and
router picks. After every step it checks each instance's health against
what ``proxy.health``'s docstring and the README promise:

- a counted failure adds to the consecutive failures and clears the
  passes; ``unhealthy_threshold`` of them in a row take a healthy
  instance out (health checks on); a passing probe or a request it served
  clears the failures;
- ``healthy_threshold`` passing probes in a row bring an instance back; a
  probe's pass counts for nothing when a failure was noted on the instance
  after it was sent;
- one passing probe admits an instance joining the pools, which takes no
  traffic before, even after failed probes (still loading, say); without
  health checks it joins unprobed;
- a request's answered failures count only if an attempt served it, once
  per instance, never against an instance that served it;
- an ejected instance is back only once its cooldown is over: with probes
  on, at a passing probe, else when the router looks at it;
- after each passing probe every decode at its URL has the context lengths
  its ``/v1/models`` gives, none when that read fails in any way (never a
  prefill's, and the read never touches health);
- no probe answer makes a round raise, and the loop runs on after a round;
- turning health checks off puts every instance back in rotation.

The backends are one aiohttp app on 127.0.0.1 behind a listening socket per
backend URL; the machine sets what each answers (statuses and bodies,
resets, a refused connection, a reply that is no HTTP, no answer at all,
bad ``/v1/models`` bodies). ``proxy.health`` reads a clock the machine
advances by hand (each read moves it a microsecond, as a real clock moves
between two reads).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar
from unittest import mock

from aiohttp import web
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import proxy.health
from proxy.config import load_config
from proxy.flow import Failure, Flow
from proxy.instances import Instance, Pool
from proxy.state import ProxyState

T = TypeVar("T")

# What a probe waits for: local answers take milliseconds, but a loaded
# machine can stall a process for a good part of a second, and a spurious
# timeout would fail the test. An answer that never comes costs this much
# wall time, so the machine draws those rarely (and for one probe).
TIMEOUT_S = 1.0
MAX_REPLY_BYTES = 4096  # the configured cap, so oversized bodies stay small
BACKENDS = 4
# Model -> role -> backend indices. Backend 1 serves two prefills, backend 3
# two decodes (one probe and one /v1/models read for both), backend 2 a
# prefill of one model and a decode of the other; backends 0 and 1 serve
# prefills only, so their /v1/models is never read.
LAYOUT: dict[str, dict[str, list[int]]] = {
    "a": {"prefill": [0, 1], "decode": [2, 3]},
    "b": {"prefill": [1, 2], "decode": [3]},
}
PREFILL_ONLY = (0, 1)


# ------------------------------------------------------------ what backends say


@dataclass(frozen=True)
class Reply:
    """One way a backend answers a GET.

    ``kind``: ``status`` (``status`` with ``body``), ``hang`` (nothing, ever),
    ``stall`` (200 headers, then part of the body, then nothing), ``reset``
    (the connection reset), ``garbage`` (bytes that are no HTTP reply),
    ``refused`` (/health only: nothing listens on the port).
    """

    kind: str
    status: int = 200
    body: bytes = b""
    chunked: bool = False
    headers: tuple[tuple[str, str], ...] = ()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # how Hypothesis prints a failing example

    def __repr__(self) -> str:
        if self.kind != "status":
            return self.kind
        extra = " chunked" if self.chunked else ""
        return f"{self.status}({len(self.body)}B{extra})"


def passes(reply: Reply) -> bool:
    """A probe passes on a 2xx answer within the timeout (whatever its body)."""
    return reply.kind == "status" and 200 <= reply.status < 300


_BIG = b"x" * 70_000  # over the 64 KiB a probe reads of a /health body
PASSING = [
    Reply("status", 200),
    Reply("status", 200, b"{}"),
    Reply("status", 204),
    Reply("status", 299, b"fine"),
    Reply("status", 200, _BIG),
    Reply("status", 200, _BIG, chunked=True),
]
FAILING = [
    Reply("status", 503, b'{"error": "loading"}'),
    Reply("status", 500),
    Reply("status", 404, b"not found"),
    Reply("status", 300),  # the first status past 2xx
    Reply("status", 302),  # no Location: nothing to follow
    Reply("status", 500, _BIG, chunked=True),
    Reply("reset"),
    Reply("refused"),
    Reply("garbage", body=b"NOT HTTP AT ALL\r\n\r\n"),
    Reply("garbage", body=b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n"),
]
# Passing answers more likely than failing ones; no answer at all is rare
# and lasts one probe (each costs TIMEOUT_S of wall time).
health_replies = st.sampled_from((PASSING * 3 + FAILING * 2) * 3 + [Reply("hang")])


def _models(*entries: Any) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


# (reply, the context lengths it gives): vLLM lists each model with its
# max_model_len and each LoRA adapter with its parent; anything else gives
# none (proxy.served).
MODELS: list[tuple[Reply, dict[str, int]]] = [
    (
        Reply(
            "status",
            body=_models(
                {"id": "m1", "max_model_len": 4096},
                {"id": "lora", "parent": "m1"},
            ),
        ),
        {"m1": 4096, "lora": 4096},
    ),
    (
        Reply(
            "status",
            body=_models(
                {"id": "m1", "max_model_len": 2048},
                {"id": "m2", "max_model_len": 8192},
            ),
            chunked=True,
        ),
        {"m1": 2048, "m2": 8192},
    ),
    (Reply("status", body=_models({"id": "m1"})), {}),
    (
        Reply(
            "status",
            body=_models(
                {"id": "a", "max_model_len": True},
                {"id": "b", "max_model_len": "4096"},
                {"id": "c", "max_model_len": -1},
                {"id": "d", "max_model_len": 0},
                {"id": "e", "max_model_len": 1.5},
                {"id": "f", "max_model_len": None},
                {"id": "g", "max_model_len": 100},
            ),
        ),
        {"g": 100},
    ),
    (
        Reply(
            "status",
            body=_models(
                1, "x", None, [], {"max_model_len": 5}, {"id": 7, "max_model_len": 9}
            ),
        ),
        {"7": 9},
    ),
    (
        Reply(
            "status",
            body=_models({"id": "l", "parent": "nope"}, {"id": "k", "parent": 5}),
        ),
        {},
    ),
    (Reply("status", body=b'{"data": {"id": "m1", "max_model_len": 5}}'), {}),
    (Reply("status", body=b'{"data": null}'), {}),
    (Reply("status", body=b'[{"id": "m1", "max_model_len": 5}]'), {}),
    (Reply("status", body=b'"data"'), {}),
    (Reply("status", body=b'{"data": [{"id": "m1", "max_model_len": 5}'), {}),
    (Reply("status", body=b"\xff\xfe{}"), {}),
    # Nested past msgspec's depth, yet under the configured reply cap.
    (Reply("status", body=b"[" * 4000), {}),
    (Reply("status", body=b'{"data": [{"id": "m", "max_model_len": 1e400}]}'), {}),
    (Reply("status", body=b"9" * 4000), {}),
    (Reply("status", 500, _models({"id": "m1", "max_model_len": 5})), {}),
    (Reply("status", 404), {}),
    (Reply("status", 204), {}),
    (
        Reply(
            "status",
            body=_models({"id": "m1", "max_model_len": 5}, {"pad": "x" * 5000}),
        ),
        {},
    ),
    (
        Reply(
            "status",
            body=_models({"id": "m1", "max_model_len": 5}, {"pad": "x" * 5000}),
            chunked=True,
        ),
        {},
    ),
    (
        Reply(
            "status",
            body=b"not gzip at all",
            headers=(("Content-Encoding", "gzip"),),
        ),
        {},
    ),
    (Reply("reset"), {}),
    (Reply("garbage", body=b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n"), {}),
    (Reply("stall", body=_models({"id": "m1", "max_model_len": 5})), {}),
    (Reply("hang"), {}),
]
# The slow ones (stall, hang) are the last two: drawn rarely, for one read.
models_replies = st.sampled_from(MODELS[:-2] * 10 + MODELS[-2:])


_SLOW = ("hang", "stall")


@dataclass
class Backend:
    """One backend URL: its socket, what it answers, what it was asked."""

    sock: socket.socket
    port: int
    health: Reply = PASSING[0]
    models: tuple[Reply, dict[str, int]] = MODELS[0]
    # What it answers again once its one slow answer is over.
    health_after: Reply = PASSING[0]
    models_after: tuple[Reply, dict[str, int]] = MODELS[0]
    site: web.SockSite | None = None
    health_hits: int = 0
    models_hits: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _bound_socket(port: int = 0) -> socket.socket:
    """A socket bound to ``port`` on 127.0.0.1, not listening: connections
    to it are refused, and no other socket can take the port meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class Backends:
    """One aiohttp app serving every backend, a listening socket each."""

    def __init__(self) -> None:
        self.backends: list[Backend] = []
        self.by_port: dict[int, Backend] = {}
        self.runner: web.AppRunner | None = None
        # Set while a round's probes wait until the machine lets them answer.
        self.gate: asyncio.Event | None = None
        self.arrived: set[int] = set()
        self.closing = asyncio.Event()

    async def start(self, n: int) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        # Handlers of a client that gave up (a probe's timeout) are cancelled.
        self.runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0
        )
        await self.runner.setup()
        for _ in range(n):
            sock = _bound_socket()
            backend = Backend(sock, sock.getsockname()[1])
            self.backends.append(backend)
            self.by_port[backend.port] = backend
            await self.listen(backend)

    async def listen(self, backend: Backend) -> None:
        assert self.runner is not None and backend.site is None
        backend.site = web.SockSite(self.runner, backend.sock)
        await backend.site.start()

    async def refuse(self, backend: Backend) -> None:
        """Stops listening on ``backend``'s port, and holds the port."""
        assert backend.site is not None
        await backend.site.stop()
        backend.site = None
        backend.sock = _bound_socket(backend.port)

    async def set_health(self, backend: Backend, reply: Reply) -> None:
        if reply.kind == "refused" and backend.site is not None:
            await self.refuse(backend)
        elif reply.kind != "refused" and backend.site is None:
            await self.listen(backend)
        if reply.kind == "hang":
            if backend.health.kind != "hang":
                backend.health_after = backend.health
        else:
            backend.health_after = reply
        backend.health = reply

    @staticmethod
    def set_models(backend: Backend, answer: tuple[Reply, dict[str, int]]) -> None:
        if answer[0].kind not in _SLOW:
            backend.models_after = answer
        backend.models = answer

    async def slow_ones_answer_again(self) -> None:
        """A backend that hung (or stalled) did so for one probe (or read)."""
        for backend in self.backends:
            if backend.health.kind == "hang":
                await self.set_health(backend, backend.health_after)
            if backend.models[0].kind in _SLOW:
                backend.models = backend.models_after

    async def stop(self) -> None:
        self.closing.set()
        if self.gate is not None:
            self.gate.set()
        if self.runner is not None:
            await self.runner.cleanup()
        for backend in self.backends:
            backend.sock.close()

    def _backend(self, request: web.Request) -> Backend:
        assert request.transport is not None
        return self.by_port[request.transport.get_extra_info("sockname")[1]]

    async def _health(self, request: web.Request) -> web.StreamResponse:
        backend = self._backend(request)
        backend.health_hits += 1
        reply = backend.health
        if reply.kind == "refused":
            # A kept-alive connection from before the port closed: as refused.
            return await self._reply(request, Reply("reset"))
        if self.gate is not None:
            self.arrived.add(backend.port)
            await self.gate.wait()
        return await self._reply(request, reply)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        backend = self._backend(request)
        backend.models_hits += 1
        return await self._reply(request, backend.models[0])

    async def _reply(self, request: web.Request, reply: Reply) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        if reply.kind == "hang":
            await self.closing.wait()
        elif reply.kind == "reset":
            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
            transport.abort()
        elif reply.kind == "garbage":
            transport.write(reply.body)
            transport.close()
        elif reply.kind == "stall":
            resp = web.StreamResponse(headers={"Content-Length": str(len(reply.body))})
            await resp.prepare(request)
            await resp.write(reply.body[: len(reply.body) // 2])
            await self.closing.wait()
            return resp
        elif reply.chunked:
            resp = web.StreamResponse(status=reply.status, headers=dict(reply.headers))
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(reply.body), 16384):
                await resp.write(reply.body[i : i + 16384])
            await resp.write_eof()
            return resp
        else:
            return web.Response(
                status=reply.status,
                body=reply.body if reply.status != 204 else None,
                headers=dict(reply.headers),
            )
        return web.Response()


# --------------------------------------------------------------- the model


class Clock:
    """``proxy.health``'s monotonic clock: the machine advances it; each
    read moves it on a microsecond, so that a failure noted before a probe
    is sent is older than the probe."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    __call__ = monotonic


@dataclass
class Expected:
    """What the documented rules say of one instance."""

    failures: int = 0  # consecutive counted failures
    passes: int = 0  # consecutive passing probes since the last failure
    healthy: bool = True
    admitted: bool = True  # was in rotation once: not a joining instance
    ejected_until: float = 0.0
    context_lens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    """The health and ejection sections of the configuration file."""

    enabled: bool
    unhealthy: int
    healthy: int
    cooldown: float

    def text(self, urls: list[str]) -> str:
        models = {
            name: {
                role: {"instances": [{"url": urls[i]} for i in indices]}
                for role, indices in roles.items()
            }
            for name, roles in LAYOUT.items()
        }
        return json.dumps(
            {
                "models": models,
                "health": {
                    "enabled": self.enabled,
                    "interval_s": 3600,  # rounds run only as rules
                    "timeout_s": TIMEOUT_S,
                    "unhealthy_threshold": self.unhealthy,
                    "healthy_threshold": self.healthy,
                },
                "ejection": {"cooldown_s": self.cooldown},
                "limits": {"max_reply_bytes": MAX_REPLY_BYTES},
            }
        )


settings_st = st.builds(
    Settings,
    enabled=st.sampled_from([True, True, True, False]),
    unhealthy=st.integers(1, 3),
    healthy=st.integers(1, 3),
    # Clock advances are multiples of a quarter second: a cooldown's end
    # never falls within the microseconds a step reads the clock across.
    cooldown=st.sampled_from([0.5, 1.0, 2.0]),
)


class HealthMachine(RuleBasedStateMachine):
    """One proxy state and its backends; rules are the events health sees,
    invariants the rules it must keep."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="kvguard-health-"))
        self.path = self.dir / "proxy.json"
        self.clock = Clock()
        self.patch = mock.patch.object(proxy.health, "time", self.clock)
        self.patch.start()
        self.backends = Backends()
        self.state: ProxyState | None = None
        self.settings: Settings | None = None
        # Every instance ever made, removed ones too (requests outlive them).
        self.expected: dict[Instance, Expected] = {}

    # ------------------------------------------------------------ plumbing

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    @property
    def proxy(self) -> ProxyState:
        assert self.state is not None
        return self.state

    @property
    def cfg(self) -> Settings:
        assert self.settings is not None
        return self.settings

    def listed(self) -> list[Instance]:
        return list(self.proxy.all_instances())

    def everyone(self) -> list[Instance]:
        return list(self.expected)

    def backend(self, inst: Instance) -> Backend:
        return self.backends.by_port[int(inst.url.rsplit(":", 1)[1])]

    def pools(self) -> list[Pool]:
        return [p for m in self.proxy.models.values() for p in (m.prefill, m.decode)]

    def teardown(self) -> None:
        async def close() -> None:
            if self.state is not None:
                await self.state.stop()
            await self.backends.stop()

        try:
            self.run(close())
        finally:
            self.loop.close()
            self.patch.stop()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -------------------------------------------------- the rules, as a model

    def counted_failure(self, inst: Instance) -> None:
        """Consecutive failures past ``unhealthy_threshold`` take it out."""
        e = self.expected[inst]
        e.failures += 1
        e.passes = 0
        if self.cfg.enabled and e.healthy and e.failures >= self.cfg.unhealthy:
            e.healthy = False

    def served(self, inst: Instance) -> None:
        """A success resets the failures (it is no probe: passes stay)."""
        self.expected[inst].failures = 0

    def passing_probe(self, inst: Instance, stale: bool) -> None:
        """``healthy_threshold`` passes bring it back, one admits an
        instance that never was in rotation; after its cooldown a pass ends
        its ejection. A pass sent before a failure noted since counts for
        nothing."""
        if stale:
            return
        e = self.expected[inst]
        e.failures = 0
        e.passes += 1
        if not e.healthy and e.passes >= (self.cfg.healthy if e.admitted else 1):
            e.healthy = e.admitted = True
        if e.ejected_until and self.clock.now >= e.ejected_until:
            e.ejected_until = 0.0

    def read_models(self, instances: list[Instance]) -> None:
        """After a passing probe each decode there takes its /v1/models' lengths."""
        for inst in instances:
            if inst.role == "decode":
                lens = self.backend(inst).models[1]
                self.expected[inst].context_lens = dict(lens)

    def joined(self, inst: Instance, enabled: bool) -> None:
        """A new instance, probed once before it joins (health checks on):
        one pass admits it, whatever ``healthy_threshold``."""
        e = self.expected[inst] = Expected()
        if not enabled:
            return
        if passes(self.backend(inst).health):
            e.passes = 1
            self.read_models([inst])
        else:
            e.failures = 1
            e.healthy = e.admitted = False

    def expect_round(self, failed_midway: set[Instance]) -> None:
        by_url: dict[str, list[Instance]] = {}
        for inst in self.listed():
            by_url.setdefault(inst.url, []).append(inst)
        for instances in by_url.values():
            ok = passes(self.backend(instances[0]).health)
            for inst in instances:
                if inst in failed_midway:
                    self.counted_failure(inst)
                if ok:
                    self.passing_probe(inst, stale=inst in failed_midway)
                else:
                    self.counted_failure(inst)
            if ok:
                self.read_models(instances)

    # --------------------------------------------------------------- start

    @initialize(
        settings=settings_st,
        replies=st.lists(health_replies, min_size=BACKENDS, max_size=BACKENDS),
        models=st.lists(models_replies, min_size=BACKENDS, max_size=BACKENDS),
    )
    def start(
        self,
        settings: Settings,
        replies: list[Reply],
        models: list[tuple[Reply, dict[str, int]]],
    ) -> None:
        """Starts the proxy's state as ``kvguard proxy`` does (each configured
        instance probed once); health rounds then run only as rules."""

        async def begin() -> ProxyState:
            await self.backends.start(BACKENDS)
            for backend, reply, answer in zip(
                self.backends.backends, replies, models, strict=True
            ):
                await self.backends.set_health(backend, reply)
                self.backends.set_models(backend, answer)
            self.path.write_text(settings.text([b.url for b in self.backends.backends]))
            state = ProxyState(load_config(self.path), source=str(self.path))
            state.router._clock = self.clock
            await state.start()
            for task in (state._health_task, state._discovery_task):
                assert task is not None
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            return state

        self.settings = settings
        self.state = self.run(begin())
        for inst in self.listed():
            self.joined(inst, settings.enabled)
        self.run(self.backends.slow_ones_answer_again())

    # --------------------------------------------------------------- rules

    @rule(i=st.integers(0, BACKENDS - 1), reply=health_replies)
    def health_answers(self, i: int, reply: Reply) -> None:
        self.run(self.backends.set_health(self.backends.backends[i], reply))

    @rule(i=st.integers(0, BACKENDS - 1), answer=models_replies)
    def models_answer(self, i: int, answer: tuple[Reply, dict[str, int]]) -> None:
        self.backends.set_models(self.backends.backends[i], answer)

    @precondition(lambda self: self.cfg.enabled)
    @rule(through_the_loop=st.booleans(), rounds=st.integers(1, 3))
    def probe_rounds(self, through_the_loop: bool, rounds: int) -> None:
        """Rounds of probes, as ``Health.run`` runs them (or called directly:
        either way no answer makes one raise). Several in a step reach
        ``healthy_threshold`` within the steps an example has."""
        for _ in range(rounds):
            if through_the_loop:
                self.run(self.loop_round())
            else:
                self.run(self.proxy.health.check_all())
            self.expect_round(set())
            self.run(self.backends.slow_ones_answer_again())

    async def loop_round(self) -> None:
        """Runs the health loop for one round: it must then go on (sleep
        until the next), with nothing raised out of the round."""
        health = self.proxy.health
        done = asyncio.Event()
        raised: list[BaseException] = []
        check_all = health.check_all

        async def watched() -> None:
            try:
                await check_all()
            except BaseException as exc:
                raised.append(exc)
                raise
            finally:
                done.set()

        health.check_all = watched  # type: ignore[method-assign]
        task = asyncio.create_task(health.run())
        try:
            await asyncio.wait_for(done.wait(), 30)
            for _ in range(3):
                await asyncio.sleep(0)
            assert not task.done(), "the health loop ended after a round"
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            del health.check_all
        assert not raised, raised

    @precondition(lambda self: self.cfg.enabled)
    @rule(which=st.sets(st.integers(0, 31), min_size=1, max_size=3))
    def probe_round_while_requests_fail(self, which: set[int]) -> None:
        """Requests fail on some instances (connection failures, counted at
        once) while the round's probes are out: those probes' passes were
        sent before the failures and count for nothing."""
        listed = self.listed()
        failing = {listed[t % len(listed)] for t in which}

        async def interleaved() -> None:
            backends = self.backends
            backends.gate = asyncio.Event()
            backends.arrived = set()
            answering = {
                self.backend(i).port
                for i in listed
                if self.backend(i).health.kind != "refused"
            }
            round_ = asyncio.create_task(self.proxy.health.check_all())
            try:
                for _ in range(2000):
                    if backends.arrived >= answering or round_.done():
                        break
                    await asyncio.sleep(0.005)
                assert backends.arrived >= answering, "probes never arrived"
                for inst in failing:
                    self.proxy.health.note(inst, ok=False)
            finally:
                backends.gate.set()
                backends.gate = None
            await round_

        self.run(interleaved())
        self.expect_round(failing)
        self.run(self.backends.slow_ones_answer_again())

    @rule(i=st.integers(0, 63))
    def connection_fails(self, i: int) -> None:
        """A connection failure of a request counts at once (requests keep a
        removed instance, so it may be one)."""
        inst = self.everyone()[i % len(self.expected)]
        self.proxy.health.note(inst, ok=False)
        self.counted_failure(inst)

    @rule(i=st.integers(0, 63))
    def request_served(self, i: int) -> None:
        """A leg answered in full: the flow notes a success."""
        inst = self.everyone()[i % len(self.expected)]
        self.proxy.health.note(inst, ok=True)
        self.served(inst)

    @rule(
        served=st.sampled_from(["nobody", "decode", "pair"]),
        p=st.integers(0, 63),
        d=st.integers(0, 63),
        failed=st.lists(st.one_of(st.none(), st.integers(0, 63)), max_size=4),
    )
    def request_settles(
        self, served: str, p: int, d: int, failed: list[int | None]
    ) -> None:
        """A request with answered failures (5xx, error events, leg timeouts)
        on some attempts ends, served by the last or by nobody; ``Flow._settle``
        counts them as the flow does. ``None``: a failure that counted at once
        (or against nothing)."""
        everyone = self.everyone()
        prefills = [i for i in everyone if i.role == "prefill"]
        decodes = [i for i in everyone if i.role == "decode"]
        by: tuple[Instance, ...] = ()
        if served == "decode":
            by = (decodes[d % len(decodes)],)
        elif served == "pair":
            by = (prefills[p % len(prefills)], decodes[d % len(decodes)])
        failures = []
        for f in failed:
            inst = None if f is None else everyone[f % len(everyone)]
            role = "decode" if inst is None else inst.role
            failures.append(Failure("x_5xx", "HTTP 500", role, True, inst))
        for inst in by:  # the serving attempt's legs answered in full
            self.proxy.health.note(inst, ok=True)
            self.served(inst)
        request = SimpleNamespace(served_by=by, unsettled=failures)
        Flow(self.proxy)._settle(request)  # type: ignore[arg-type]
        if by:
            for inst in {f.instance for f in failures} - {None, *by}:
                assert inst is not None
                self.counted_failure(inst)

    @rule(i=st.integers(0, 31))
    def ejected(self, i: int) -> None:
        """The integrity tracker ejects an instance (as ``_judge`` does)."""
        listed = [i for i in self.listed() if not i.ejected]
        if not listed:
            return
        inst = listed[i % len(listed)]
        inst.ejected_until = self.clock() + self.cfg.cooldown
        inst.ejections += 1
        self.expected[inst].ejected_until = inst.ejected_until

    @rule(seconds=st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(i=st.integers(0, 31), drain=st.booleans())
    def admin_drains(self, i: int, drain: bool) -> None:
        listed = self.listed()
        self.proxy.discovery.drained_by_admin(listed[i % len(listed)], drain)

    @rule(i=st.integers(0, 31))
    def admin_removes(self, i: int) -> None:
        """The admin API removes an instance (never a pool's last)."""
        pools = [p for p in self.pools() if len(p.instances) > 1]
        if not pools:
            return
        pool = pools[i % len(pools)]
        inst = pool.instances[i % len(pool.instances)]
        self.proxy.remove_instances({inst})
        self.proxy.discovery.removed_by_admin({inst})

    @rule(settings=settings_st)
    def reload(self, settings: Settings) -> None:
        """A reload with new health settings: instances the admin API removed
        come back as new ones, probed first under the new settings."""
        before = set(self.listed())
        self.path.write_text(settings.text([b.url for b in self.backends.backends]))
        assert self.run(self.proxy.reload())
        self.settings = settings
        for inst in self.listed():
            if inst not in before:
                assert inst not in self.expected
                self.joined(inst, settings.enabled)
            elif not settings.enabled:
                e = self.expected[inst]
                if not e.healthy:  # nothing would probe it back
                    e.healthy, e.failures = True, 0
        self.run(self.backends.slow_ones_answer_again())

    @rule(i=st.integers(0, 31))
    def router_picks(self, i: int) -> None:
        """The router picks from a pool: never an unusable instance; without
        probes it ends the ejections whose cooldown is over."""
        pool = self.pools()[i % len(self.pools())]
        before = {inst: inst.ejected_until for inst in pool.instances}
        picked = self.proxy.router.pick(pool, probing=self.cfg.enabled)
        assert (picked is None) == (not any(i.usable() for i in pool.instances))
        assert picked is None or picked.usable()
        for inst, until in before.items():
            if until and not inst.ejected:
                assert not self.cfg.enabled, f"{inst} back without a probe"
                assert self.clock.now >= until, f"{inst} back before its cooldown"
                self.expected[inst].ejected_until = 0.0

    # ---------------------------------------------------------- invariants

    @invariant()
    def each_instance_is_as_the_rules_say(self) -> None:
        if self.state is None:
            return
        for inst, e in self.expected.items():
            seen = Expected(
                failures=inst.consecutive_failures,
                passes=inst.consecutive_successes,
                healthy=inst.healthy,
                admitted=inst.admitted,
                ejected_until=inst.ejected_until,
                context_lens=inst.context_lens,
            )
            assert seen == e, f"{inst} ({inst.model}): {seen} != {e}"

    @invariant()
    def usable_means_healthy_in_service_and_not_drained(self) -> None:
        for inst in self.expected:
            assert inst.usable() == (
                inst.healthy and not inst.drained and not inst.removed
            )

    @invariant()
    def only_decodes_have_their_models_read(self) -> None:
        for i in PREFILL_ONLY:
            if self.backends.backends:
                assert self.backends.backends[i].models_hits == 0


# Each example starts the backends and a proxy state (~20 ms) and runs up
# to 25 steps of a few ms each; a round waits TIMEOUT_S when a backend never
# answers (rare draws). 60 examples take ~3 s on an idle core, so well under
# 10 s on a loaded 2-core machine. Raise max_examples locally when changing
# proxy.health.
SETTINGS = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_probes_passive_outcomes_ejections_and_reloads_keep_the_health_rules() -> None:
    run_state_machine_as_test(HealthMachine, settings=SETTINGS)


@contextmanager
def one_strike_machine() -> Iterator[HealthMachine]:
    """A started machine whose instances go out at one failure and come
    back at one pass, every backend answering as it should; torn down after."""
    machine = HealthMachine()
    try:
        machine.start(
            settings=Settings(enabled=True, unhealthy=1, healthy=1, cooldown=1.0),
            replies=[PASSING[0]] * BACKENDS,
            models=[MODELS[0]] * BACKENDS,
        )
        yield machine
    finally:
        machine.teardown()


def test_answers_that_never_come_fail_the_probe_and_leave_health_to_it() -> None:
    """The machine draws them rarely (each costs a probe's timeout): a
    /health that never answers is a failed probe, and a /v1/models that
    never answers, or stalls mid-body, gives no lengths and no failure."""
    with one_strike_machine() as machine:
        machine.health_answers(0, Reply("hang"))
        machine.models_answer(2, MODELS[-1])  # hangs
        machine.models_answer(3, MODELS[-2])  # stalls
        machine.probe_rounds(through_the_loop=True, rounds=1)
        machine.each_instance_is_as_the_rules_say()
        a = machine.proxy.models["a"]
        assert not a.prefill.instances[0].healthy
        assert all(d.healthy and d.context_lens == {} for d in a.decode.instances)
        machine.probe_rounds(through_the_loop=False, rounds=1)  # answering again
        machine.each_instance_is_as_the_rules_say()
        assert a.prefill.instances[0].healthy
        assert all(d.context_lens == MODELS[0][1] for d in a.decode.instances)


def test_a_probe_passes_on_each_2xx_answer_and_fails_on_each_other() -> None:
    """Every answer the machine draws from, each in turn (the machine may
    not draw a rare one): healthy on a 2xx whatever its body, out on
    anything else, 300 included."""
    with one_strike_machine() as machine:
        answers = [*FAILING, *PASSING]
        for start in range(0, len(answers), BACKENDS):
            batch = answers[start : start + BACKENDS]
            for i, reply in enumerate(batch):
                machine.health_answers(i, reply)
            machine.probe_rounds(through_the_loop=False, rounds=1)
            machine.each_instance_is_as_the_rules_say()
            for i, reply in enumerate(batch):
                backend = machine.backends.backends[i]
                healthy = [
                    inst.healthy
                    for inst in machine.listed()
                    if machine.backend(inst) is backend
                ]
                assert healthy and all(h == passes(reply) for h in healthy), reply
