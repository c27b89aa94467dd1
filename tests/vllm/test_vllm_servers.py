"""The real-vLLM harness's own behaviour: a start stalled in NIXL's agent
creation, whose log falls silent (also one that must fail), or whose warm-up
gets no answer, is named as such and started again once; the benchmark's
shares of the CPU for NIXL's pollers set each thread's policy and nice value."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from pathlib import Path

import aiohttp
import pytest
import vllm_servers
from aiohttp import web
from vllm_servers import NIXL_INIT_BEGIN, EngineSpec, Servers, StartStalled, VllmServer

pytestmark = pytest.mark.vllm


class StallingServer(VllmServer):
    """A "server" that logs NIXL's agent creation and never gets further."""

    last_line = f"INFO [base_worker.py:515] {NIXL_INIT_BEGIN}"
    argv = ("sleep", "60")

    def start(self, spec: EngineSpec, kv_transfer_config: object = None) -> None:
        self.spec = spec
        self.starts += 1
        self.log_path = self.log_path.with_name(f"{self.name}-{self.starts}.log")
        self.log_path.write_text(f"{self.last_line}\n")
        self._launched(subprocess.Popen(self.argv, process_group=0))
        self.started_s = vllm_servers.time.monotonic()


class SilentServer(StallingServer):
    """A "server" whose log falls silent before NIXL is reached."""

    last_line = "INFO [core.py:97] Initializing a V1 LLM engine"


class RefusingServer(SilentServer):
    """A "server" that exits at once with code 3, as vLLM does on a bad config."""

    argv = ("sh", "-c", "exit 3")


@pytest.fixture
def stall_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_servers, "NIXL_STALL_S", 0.5)
    monkeypatch.setattr(vllm_servers, "START_SILENT_S", 1.5)


@pytest.mark.usefixtures("stall_after")
async def test_a_start_stalled_in_nixl_agent_creation_is_named_with_its_threads(
    tmp_path: Path,
) -> None:
    server = StallingServer("stalling", 0, tmp_path / "stalling.log")
    server.start(EngineSpec("consumer"))
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(
                StartStalled, match=r"NIXL agent creation stalled .*sleep/"
            ):
                await server.wait_ready(session)
    finally:
        server.stop()


@pytest.mark.usefixtures("stall_after")
@pytest.mark.parametrize(
    ("server_class", "reason"),
    [
        (StallingServer, r"NIXL agent creation stalled"),
        (SilentServer, r"log silent 2 s at start, after: '.*V1 LLM engine'"),
    ],
)
async def test_a_stalled_start_is_started_again_once_and_then_fails(
    tmp_path: Path, server_class: type[StallingServer], reason: str
) -> None:
    server = server_class("stalling", 0, tmp_path / "stalling.log")
    spec = EngineSpec("consumer")
    async with aiohttp.ClientSession() as session:
        servers = Servers(session)
        server.start(spec)
        try:
            with pytest.raises(StartStalled, match=reason):
                await servers._ready(server, spec)
        finally:
            server.stop()
    assert server.starts == 2
    assert re.search(reason, server.restarted)
    assert server.process is None


@pytest.mark.usefixtures("stall_after")
async def test_a_start_that_must_fail_gives_its_exit_code_or_is_named_stalled(
    tmp_path: Path,
) -> None:
    """A refused config's start is waited for to its exit; one whose log
    falls silent first is a stalled start, as one that must succeed."""
    refusing = RefusingServer("refusing", 0, tmp_path / "refusing.log")
    refusing.start(EngineSpec("consumer"))
    try:
        assert await refusing.wait_exit(60) == 3
    finally:
        refusing.stop()
    silent = SilentServer("silent", 0, tmp_path / "silent.log")
    silent.start(EngineSpec("consumer"))
    try:
        with pytest.raises(StartStalled, match=r"log silent 2 s at start"):
            await silent.wait_exit(60)
    finally:
        silent.stop()


async def test_a_warm_up_without_an_answer_is_a_stalled_start_started_again_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_servers, "WARM_UP_STALL_S", 0.5)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def never(_: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/v1/completions", never)])
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    server = StallingServer("warm-up", port, tmp_path / "warm-up.log")
    spec = EngineSpec("consumer")
    try:
        async with aiohttp.ClientSession() as session:
            server.start(spec)
            with pytest.raises(StartStalled, match=r"warm-up got no answer in 0 s"):
                await Servers(session)._ready(server, spec)
    finally:
        server.stop()
        await runner.cleanup()
    assert server.starts == 2
    assert "its warm-up got no answer" in server.restarted


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a nice value needs root")
def test_poller_shares_set_each_threads_policy_and_nice_value() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    tid = sleeper.pid
    try:
        vllm_servers.set_poller_share([tid], "idle")
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        vllm_servers.set_poller_share([tid], "full")
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        vllm_servers.set_poller_share([tid], "nice")
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, tid) == 19
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_instance_of_tp_2_is_known_by_its_args(tmp_path: Path) -> None:
    # Its warm-up gets WARM_UP_COMPILE_S: vLLM compiles on its first forward.
    server = StallingServer("tp", 0, tmp_path / "tp.log")
    assert server.tensor_parallel == 1
    server.spec = EngineSpec("producer", args=("--tensor-parallel-size", "2"))
    assert server.tensor_parallel == 2
    server.spec = EngineSpec("producer", args=("--max-num-seqs", "4"))
    assert server.tensor_parallel == 1
