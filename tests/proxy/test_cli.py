"""``kvguard proxy`` as a process: no-YAML starts, toy-proxy flags, SIGHUP
reload, backends over TLS."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from proxy_helpers import expected_text, read_sse

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
    *args: str, env: Mapping[str, str] | None = None
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
        env=env,
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


async def complete_streamed(
    url: str, prompt: str = "hi"
) -> tuple[int, bytes, str, list[Any]]:
    """(status, the SSE body, its text, its error events)."""
    body = {"prompt": prompt, "max_tokens": 3, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        events = await resp.read()
        text, errors = await read_sse(resp)  # the body read above, kept
        return resp.status, events, text, errors


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


def test_backends_on_the_command_line_need_both_roles_and_no_config_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("models: {}\n")
    for flags in (["--prefill", "http://p:1"], ["--decode", "http://d:2"]):
        with pytest.raises(ConfigError, match="either --config or backend URLs"):
            config_from_args(build_parser().parse_args(["--config", str(path), *flags]))
        with pytest.raises(ConfigError, match="no backends"):
            config_from_args(build_parser().parse_args(flags))


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


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command (apt-get install openssl)")
    subprocess.run([openssl, *args], check=True, capture_output=True)


@pytest.fixture
def private_ca(tmp_path: Path) -> tuple[Path, ssl.SSLContext]:
    """A private CA's certificate, and a server context for 127.0.0.1 whose
    certificate it signed: a backend behind an operator's own CA."""
    ca, ca_key = tmp_path / "ca.pem", tmp_path / "ca.key"
    cert, key, csr = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "csr"
    ext = tmp_path / "ext.cnf"
    ext.write_text(
        "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=kvguard test CA",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    _openssl("req", *ec, "-subj", "/CN=127.0.0.1", "-keyout", str(key),
             "-out", str(csr))  # fmt: skip
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey",
             str(ca_key), "-set_serial", "1", "-days", "2", "-extfile",
             str(ext), "-out", str(cert))  # fmt: skip
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return ca, context


async def test_https_backends_behind_a_ca_the_proxy_trusts_serve_every_leg(
    stubs, private_ca
):
    """Probes, prefill and decode legs all go over TLS, verified against the
    CA that ``SSL_CERT_FILE`` names (how an operator trusts a private CA)."""
    ca, context = private_ca
    p, d = await stubs(ssl_context=context), await stubs(ssl_context=context)
    assert p.url.startswith("https://")
    env = {**os.environ, "SSL_CERT_FILE": str(ca)}
    async with proxy_process("--prefill", p.url, "--decode", d.url, env=env) as (
        url,
        _,
    ):
        assert await complete(url) == (200, expected_text("hi", 3))
        status, events, text, errors = await complete_streamed(url, "ho")
    assert status == 200 and events.endswith(b"data: [DONE]\n\n")
    assert text == expected_text("ho", 3) and not errors
    assert p.health_checks >= 1 and d.health_checks >= 1
    assert len(p.requests) == len(d.requests) == 2


@pytest.mark.parametrize("probes", ["probes on", "probes off"])
async def test_an_https_backend_the_proxy_cannot_verify_gets_no_request(
    stubs, private_ca, tmp_path, probes
):
    """Without its CA trusted, a backend's certificate fails verification:
    the request fails (503) and nothing reaches the backend: not a probe,
    nor, with probes off, a leg."""
    _, context = private_ca
    p, d = await stubs(ssl_context=context), await stubs(ssl_context=context)
    config = tmp_path / "proxy.yaml"
    config.write_text(
        f"health: {{enabled: {str(probes == 'probes on').lower()}}}\n"
        f"models:\n  '*':\n    prefill: {{instances: [{{url: '{p.url}'}}]}}\n"
        f"    decode: {{instances: [{{url: '{d.url}'}}]}}\n"
    )
    async with proxy_process("--config", str(config)) as (url, _):
        status, text = await complete(url)
    assert status == 503 and "prefill" in text
    assert not p.requests and not d.requests
    assert p.health_checks == d.health_checks == 0
