"""Helpers for the operations tests: real dnsmasq, Prometheus and Chromium
processes on free local ports and a steady client load.

Each external program is a Debian package that ``.ci/run`` installs; where one
is missing, ``need()`` skips the test and says which package to install.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from tests.support import REPO
from tests.support.ports import free_port
from tests.support.programs import need

DEPLOY = REPO / "deploy"


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    what: str,
    within: float = 20.0,
    interval: float = 0.05,
) -> None:
    """Polls ``check`` until true; fails saying ``what`` did not happen in time."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within}s")
        await asyncio.sleep(interval)


# ------------------------------------------------------------------ dnsmasq


class Dnsmasq:
    """A real dnsmasq answering A/AAAA records from a hosts file on a free port.

    ``set_records`` rewrites the file and sends SIGHUP, which makes dnsmasq
    re-read it; nothing else (no upstream, no /etc/hosts) is answered.
    """

    def __init__(self, domain: str = "kv.test") -> None:
        self.binary = need("dnsmasq", "dnsmasq-base")
        # Readable by the user dnsmasq drops to (pytest's tmp dirs are 0700).
        self.dir = Path(tempfile.mkdtemp(prefix="kvguard-dns-"))
        self.dir.chmod(0o755)
        self.hosts = self.dir / "hosts"
        self.domain = domain
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def _write(self, records: dict[str, list[str]]) -> None:
        lines = [f"{addr} {name}" for name, addrs in records.items() for addr in addrs]
        tmp = self.dir / "hosts.new"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.chmod(0o644)
        tmp.replace(self.hosts)

    async def start(self, records: dict[str, list[str]]) -> int:
        """Starts serving ``records`` (name -> addresses); returns the port."""
        self._write(records)
        self._spawn()
        for name, addrs in records.items():
            await self.wait_for(name, set(addrs))
        return self.port

    def _spawn(self) -> None:
        self.port = free_port(udp=True)
        args = [
            self.binary,
            "--keep-in-foreground",
            f"--port={self.port}",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts}",
            f"--local=/{self.domain}/",
            "--cache-size=0",
            "--conf-file=/dev/null",
            "--pid-file=",
            "--log-facility=-",
        ]
        if os.geteuid() == 0:
            args.append("--user=root")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    async def set_records(self, records: dict[str, list[str]]) -> None:
        """Changes the records and waits until dnsmasq answers with them."""
        assert self.proc is not None
        self._write(records)
        self.proc.send_signal(signal.SIGHUP)
        for name, addrs in records.items():
            await self.wait_for(name, set(addrs))

    async def lookup(self, name: str) -> set[str]:
        import aiodns
        from pycares import AAAARecordData, ARecordData

        resolver = aiodns.DNSResolver(
            nameservers=[f"127.0.0.1:{self.port}"], timeout=0.5, tries=1
        )
        found: set[str] = set()
        try:
            for qtype in ("A", "AAAA"):
                try:
                    answer = await resolver.query_dns(name, qtype)
                except aiodns.error.DNSError:
                    continue
                found |= {
                    str(r.data.addr)
                    for r in answer.answer
                    if isinstance(r.data, ARecordData | AAAARecordData)
                }
        finally:
            await resolver.close()
        return found

    async def wait_for(self, name: str, addrs: set[str]) -> None:
        async def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read() if self.proc.stderr else b""
                pytest.fail(f"dnsmasq exited: {err.decode(errors='replace')}")
            return await self.lookup(name) == addrs

        await eventually(answers, f"dnsmasq answering {name} with {addrs}", 10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -------------------------------------------------------------------- proxy


async def get_text(url: str, **kwargs: Any) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(url, **kwargs) as resp,
    ):
        return resp.status, await resp.text()


# --------------------------------------------------------------------- load


async def complete(
    session: aiohttp.ClientSession,
    proxy: str,
    prompt: str,
    stream: bool,
    max_tokens: int = 8,
) -> tuple[int, str | None]:
    """(status, text) of one completion through ``proxy``; text None on error.

    The text may be empty: the fake model ends some prompts' completions with
    EOS as their first token (1 in 128), which is a success.
    """
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with session.post(proxy + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, None
        if not stream:
            return 200, str((await resp.json())["choices"][0]["text"])
        parts = []
        for event in (await resp.read()).split(b"\n\n"):
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            obj = msgspec.json.decode(event[6:])
            if "error" in obj:
                return 200, None
            parts.append(obj["choices"][0].get("text") or "")
        return 200, "".join(parts)


@dataclass
class Load:
    """A steady client load: ``concurrency`` loops of completions until stopped.

    A result is (status, whether a completion came back without an error).
    """

    proxy: str
    concurrency: int = 3
    results: list[tuple[int, bool]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def _loop(self, index: int) -> None:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=60)
        ) as session:
            n = 0
            while not self._stop.is_set():
                n += 1
                prompt = f"client {index} asks question {n} about KV transfers"
                status, text = await complete(session, self.proxy, prompt, n % 2 == 0)
                self.results.append((status, text is not None))

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [
            asyncio.create_task(self._loop(i)) for i in range(self.concurrency)
        ]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    @property
    def failures(self) -> list[tuple[int, bool]]:
        return [r for r in self.results if r != (200, True)]


# ----------------------------------------------------------------- browser


def chromium(*args: str, profile: Path, within: float = 90) -> str:
    """Runs headless Chromium (as root too) with ``args``; returns its stdout."""
    binary = need("chromium", "chromium")
    cmd = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, timeout=within, check=False)
    if done.returncode != 0:
        pytest.fail(f"chromium failed: {done.stderr.decode(errors='replace')[-2000:]}")
    return done.stdout.decode()


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, RGB rows) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(
                ">IIBBBBB", body
            )
            assert depth == 8 and color in (2, 6) and not interlace, "unsupported PNG"
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        filt, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for x in range(stride):
            left = line[x - channels] if x >= channels else 0
            up = prev[x]
            corner = prev[x - channels] if x >= channels else 0
            if filt == 1:
                line[x] = (line[x] + left) & 255
            elif filt == 2:
                line[x] = (line[x] + up) & 255
            elif filt == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif filt == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[x] = (line[x] + pred) & 255
        prev = line
        if channels == 4:
            line = bytearray(b for i, b in enumerate(line) if i % 4 != 3)
        rows.append(bytes(line))
    return width, height, rows


def count_color(rows: list[bytes], rgb: tuple[int, int, int]) -> int:
    """Pixels of exactly ``rgb``."""
    needle = bytes(rgb)
    total = 0
    for row in rows:
        for x in range(0, len(row), 3):
            if row[x : x + 3] == needle:
                total += 1
    return total
