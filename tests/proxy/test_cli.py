"""``kvguard proxy`` as a process: no-YAML starts, toy-proxy flags, SIGHUP reload."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from proxy_helpers import expected_text

from proxy.cli import (
    GC_YOUNG_THRESHOLD,
    build_parser,
    config_from_args,
    overrides_from_args,
    serve,
)
from proxy.config import ConfigError, config_from_urls
from proxy.testing import running_proxy
from tests.support.ports import free_port


@asynccontextmanager
async def proxy_process(
    *args: str,
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvguard.cli",
        "proxy",
        "--port",
        str(port),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"listening on" in line, line
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 15)


async def stderr_line(
    proc: asyncio.subprocess.Process, text: bytes, within: float
) -> bytes:
    """The first line of the process's stderr containing ``text``.

    Raises:
        TimeoutError: none within ``within`` seconds.
    """
    assert proc.stderr is not None
    async with asyncio.timeout(within):
        while True:
            line = await proc.stderr.readline()
            if text in line:
                return line
            if not line:
                raise AssertionError(f"stderr ended without {text!r}")


async def complete(url: str, prompt: str = "hi") -> tuple[int, str]:
    body = {"prompt": prompt, "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        reply = await resp.json()
    text = reply["choices"][0]["text"] if resp.status == 200 else str(reply)
    return resp.status, text


def test_toy_proxy_flags_pair_hosts_with_ports():
    args = build_parser().parse_args(
        [
            "--prefiller-hosts",
            "a",
            "b",
            "--prefiller-ports",
            "1",
            "2",
            "--decoder-host",
            "c",
            "--decoder-ports",
            "3",
            "4",
        ]
    )
    config, source = config_from_args(args)
    pools = config.models["*"]
    assert [i.url for i in pools.prefill.instances] == ["http://a:1", "http://b:2"]
    assert [i.url for i in pools.decode.instances] == ["http://c:3", "http://c:4"]
    assert source is None
    with pytest.raises(ConfigError, match="prefiller-hosts has 2"):
        config_from_args(
            build_parser().parse_args(
                [
                    "--prefiller-hosts",
                    "a",
                    "b",
                    "--prefiller-ports",
                    "1",
                    "2",
                    "3",
                    "--decode",
                    "http://c:3",
                ]
            )
        )
    with pytest.raises(ConfigError, match="no backends"):
        config_from_args(build_parser().parse_args([]))
    args = ["--prefiller-hosts", "::1", "--decoder-hosts", "::1"]
    config, _ = config_from_args(build_parser().parse_args(args))
    assert config.models["*"].prefill.instances[0].url == "http://[::1]:8100"


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_flag_out_of_range_is_a_config_error(port):
    args = ["--prefill", "http://p:1", "--decode", "http://d:2", "--port", port]
    with pytest.raises(ConfigError, match=r"command line \(server\): port"):
        config_from_args(build_parser().parse_args(args))


async def test_a_reload_keeps_what_the_command_line_set(stubs, tmp_path):
    p, d = await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"
    path.write_text(
        f"models:\n  m:\n    prefill: {{instances: [{{url: '{p.url}'}}]}}\n"
        f"    decode: {{instances: [{{url: '{d.url}'}}]}}\n"
        "logging: {level: warning}\n"
    )
    args = build_parser().parse_args(["--config", str(path), "--log-level", "debug"])
    config, source = config_from_args(args)
    overrides = overrides_from_args(args)
    level = logging.getLogger("kvguard.proxy").level
    try:
        async with running_proxy(config, source, overrides=overrides) as px:
            assert await px.state.reload()
            assert px.state.config.logging.level == "debug"
            assert logging.getLogger("kvguard.proxy").level == logging.DEBUG
    finally:
        logging.getLogger("kvguard.proxy").setLevel(level)


async def test_toy_proxy_flags_start_a_working_proxy(stubs):
    p, d = await stubs(), await stubs()
    async with proxy_process(
        "--prefiller-hosts",
        "127.0.0.1",
        "--prefiller-ports",
        str(p.port),
        "--decoder-hosts",
        "127.0.0.1",
        "--decoder-ports",
        str(d.port),
    ) as (url, _):
        assert await complete(url) == (200, expected_text("hi", 3))
    assert len(p.requests) == len(d.requests) == 1


async def test_sighup_reloads_the_file_and_keeps_serving(stubs, tmp_path):
    p1, p2, d = await stubs(), await stubs(), await stubs()
    path = tmp_path / "proxy.yaml"
    template = (
        "models:\n  '*':\n    prefill: {{instances: [{{url: {p}}}]}}\n"
        "    decode: {{instances: [{{url: {d}}}]}}\n"
    )
    path.write_text(template.format(p=p1.url, d=d.url))
    async with proxy_process("--config", str(path)) as (url, proc):
        assert (await complete(url))[0] == 200
        path.write_text(template.format(p=p2.url, d=d.url))
        proc.send_signal(signal.SIGHUP)
        # The reload reads the file in a thread: 10-30 ms here, far more on a
        # loaded machine. Requests sent meanwhile are served, by either prefill.
        reloaded = asyncio.create_task(
            stderr_line(proc, b"configuration reloaded", within=30)
        )
        while not reloaded.done():
            assert (await complete(url))[0] == 200
        await reloaded
        before = len(p1.requests)
        assert (await complete(url))[0] == 200
        assert (await complete(url))[0] == 200
    assert len(p1.requests) == before and len(p2.requests) >= 2


async def test_serving_collects_young_objects_less_often():
    saved = gc.get_threshold()
    config = config_from_urls(
        ["http://127.0.0.1:9"], ["http://127.0.0.1:9"], server={"port": 0}
    )
    ready, stop = asyncio.Event(), asyncio.Event()
    serving = asyncio.create_task(
        serve(config, on_ready=lambda _: ready.set(), stop=stop)
    )
    try:
        await asyncio.wait_for(ready.wait(), 30)
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *saved[1:])
    finally:
        stop.set()
        await serving
        gc.set_threshold(*saved)
