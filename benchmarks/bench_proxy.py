"""Proxy throughput and latency: direct-to-decode vs KVGuard's proxy vs vllm-router.

One run, same machine, same fake engines (instant compute, small model), 1P1D:
a closed loop of ``--concurrency`` clients sends completions, non-stream then
stream, to each target in turn and reports requests/s, p50/p99 latency and
each proxy's CPU per request (its user+system time over the measured phase:
on a machine the engines share, that CPU comes out of the engines), then the
ratios. Bounded by ``--requests`` and ``--duration`` per target, mode and
round.

The targets run in ``--rounds`` interleaved rounds, each round starting with
the next target, so that load from other processes, which comes and goes
over seconds, falls on all of them alike. A ratio is taken within each round
(its targets ran back to back) and printed as the median over rounds with
its spread (lowest-highest).

With ``--instructions`` the proxies run under valgrind's callgrind, and
each reports the user-space instructions it executed per request over the
measured requests: on a quiet machine two runs agree to within 1%, where
CPU time per request moves by 10-20%. The decode's chunking follows timing,
so under other load the counts move by a few percent: compare versions
within one run. ``--baseline DIR`` adds a KVGuard proxy run from another
checkout (a ``git worktree`` of the commit before) and the ratios against
it. The count leaves out kernel time, and a Rust binary's instructions are
not a Python program's: against the router it is a second figure, not the
CPU goal. One round, the direct target left out; needs valgrind
(``apt-get install valgrind``).

    .venv/bin/python benchmarks/bench_proxy.py
    # vllm-router in its own environment (found at .venv-bench/bin/vllm-router):
    python3.11 -m venv .venv-bench && .venv-bench/bin/pip install vllm-router==0.1.17

Not a test: figures depend on the machine. Direct-to-decode sends the plain
body to the decode, which prefills locally: the floor of what a proxy adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
# Small shapes keep the engines' CPU cost low, so the proxies' share shows.
ENGINE_SHAPE = [
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-size",
    "16",
    "--log-level",
    "WARNING",
]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass
class Result:
    target: str
    mode: str
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    round: int = 0
    proxy_cpu_ms_per_req: float | None = None
    instructions_per_req: float | None = None


def cpu_seconds(pid: int) -> float | None:
    """User+system CPU time of a process so far (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Processes:
    """Child processes started by this run; all stopped by PID at the end."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def wait_ready(url: str, within_s: float = 60) -> None:
    """Polls until ``url`` answers 200.

    Raises:
        TimeoutError: it did not within ``within_s`` seconds.
    """
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(
                    url, timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {within_s}s")


async def one(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool
) -> bool:
    async with session.post(
        url, data=body, headers={"Content-Type": "application/json"}
    ) as resp:
        if stream:
            ok = resp.status == 200
            async for _ in resp.content.iter_any():
                pass
            return ok
        await resp.read()
        return resp.status == 200


async def load(
    base: str,
    stream: bool,
    args: argparse.Namespace,
    pid: int | None = None,
    warmup: int = 64,
) -> tuple[int, int, float, list[float], float | None]:
    """Closed-loop load: (requests, errors, seconds, latencies, CPU seconds).

    The CPU seconds are those process ``pid`` spent in the measured phase
    (after the warm-up), None without a pid or /proc.
    """
    url = base + "/v1/completions"
    payload = {
        "model": "kvguard/fake-model",
        "prompt": PROMPT,
        "max_tokens": args.max_tokens,
        "stream": stream,
    }
    body = json.dumps(payload).encode()
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        await asyncio.gather(*(one(session, url, body, stream) for _ in range(warmup)))
        cpu_before = None if pid is None else cpu_seconds(pid)
        budget = args.requests
        stop_at = time.monotonic() + args.duration

        async def worker() -> None:
            nonlocal budget, errors
            while budget > 0 and time.monotonic() < stop_at:
                budget -= 1
                started = time.perf_counter()
                try:
                    ok = await one(session, url, body, stream)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                latencies.append(time.perf_counter() - started)
                errors += not ok

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        seconds = time.perf_counter() - started
        cpu_after = None if pid is None else cpu_seconds(pid)
    cpu = None
    if cpu_before is not None and cpu_after is not None:
        cpu = cpu_after - cpu_before
    return len(latencies), errors, seconds, latencies, cpu


def summarize(
    target: str,
    mode: str,
    n: int,
    errors: int,
    secs: float,
    lat: list[float],
    round_: int = 0,
) -> Result:
    lat = sorted(lat)
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
    return Result(
        target,
        mode,
        n,
        errors,
        round(secs, 2),
        round(n / secs, 1) if secs else 0.0,
        round(statistics.median(lat) * 1000, 2) if lat else float("nan"),
        round(p99 * 1000, 2),
        round_,
    )


def router_binary(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    local = ROOT / ".venv-bench" / "bin" / "vllm-router"
    if local.exists():
        return str(local)
    return shutil.which("vllm-router")


def under_callgrind(argv: list[str], out: Path) -> list[str]:
    """``argv`` run by callgrind, its counts dumped to ``out`` (and
    ``out.N`` for the N-th dump on request)."""
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]


def callgrind_control(option: str, pid: int) -> None:
    """Zeroes (``-z``) or dumps (``-d``) the counts of callgrind's ``pid``.

    Raises:
        subprocess.CalledProcessError: callgrind_control failed.
    """
    subprocess.run(
        ["callgrind_control", option, str(pid)], check=True, capture_output=True
    )


def dumped_instructions(out: Path) -> int:
    """The instruction count of the latest dump of ``out`` (``totals:``).

    Raises:
        ValueError: no dump of ``out`` holds a count.
    """
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text().splitlines() if dumps else ():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError(f"no callgrind dump of {out}")


async def measure(
    name: str,
    url: str,
    pid: int | None,
    stream: bool,
    args: argparse.Namespace,
    rnd: int,
    callgrind_out: Path | None = None,
) -> Result:
    """One target's measured phase in one mode and round: CPU time per
    request, or with ``callgrind_out`` the instructions per request."""
    mode = "stream" if stream else "non-stream"
    if callgrind_out is None or pid is None:
        n, errors, secs, lat, cpu_s = await load(url, stream, args, pid, args.warmup)
        result = summarize(name, mode, n, errors, secs, lat, rnd)
        if cpu_s is not None and n:
            result.proxy_cpu_ms_per_req = round(cpu_s * 1000 / n, 3)
        return result
    await load(url, stream, args, None, args.warmup)
    callgrind_control("-z", pid)
    n, errors, secs, lat, _ = await load(url, stream, args, None, 0)
    callgrind_control("-d", pid)
    result = summarize(name, mode, n, errors, secs, lat, rnd)
    if n:
        result.instructions_per_req = round(dumped_instructions(callgrind_out) / n)
    return result


async def run(args: argparse.Namespace) -> list[Result]:
    logdir = Path(tempfile.mkdtemp(prefix="bench_proxy_"))
    procs = Processes(logdir)
    kvguard = [sys.executable, "-m", "kvguard.cli"]
    results: list[Result] = []
    try:
        p_port, d_port = free_port(), free_port()
        prefill = f"http://127.0.0.1:{p_port}"
        decode = f"http://127.0.0.1:{d_port}"
        procs.start(
            "prefill",
            [
                *kvguard,
                "fake-engine",
                "--role",
                "producer",
                "--port",
                str(p_port),
                *ENGINE_SHAPE,
            ],
        )
        procs.start(
            "decode",
            [
                *kvguard,
                "fake-engine",
                "--role",
                "consumer",
                "--port",
                str(d_port),
                *ENGINE_SHAPE,
            ],
        )
        await wait_ready(prefill + "/health")
        await wait_ready(decode + "/health")
        targets: list[tuple[str, str, int | None]] = []
        if not args.instructions:
            targets.append(("direct-decode", decode, None))

        def proxy_args(port: int) -> list[str]:
            return [
                "proxy",
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--port",
                str(port),
                "--log-level",
                args.proxy_log_level,
            ]

        def callgrind_out(name: str) -> Path | None:
            return logdir / f"{name}.callgrind" if args.instructions else None

        def traced(name: str, argv: list[str]) -> list[str]:
            out = callgrind_out(name)
            return argv if out is None else under_callgrind(argv, out)

        # Under callgrind a proxy starts tens of times slower.
        ready_s = 600 if args.instructions else 60
        proxy_port = free_port()
        proxy_proc = procs.start(
            "kvguard-proxy",
            traced("kvguard-proxy", [*kvguard, *proxy_args(proxy_port)]),
        )
        proxy = f"http://127.0.0.1:{proxy_port}"
        await wait_ready(proxy + "/health", ready_s)
        targets.append(("kvguard-proxy", proxy, proxy_proc.pid))

        if args.baseline:
            baseline_port = free_port()
            # The other checkout's packages first on the path: its kvguard.
            run_from = (
                "import sys; sys.path.insert(0, sys.argv.pop(1)); "
                "from kvguard.cli import main; sys.exit(main())"
            )
            baseline_proc = procs.start(
                "kvguard-baseline",
                traced(
                    "kvguard-baseline",
                    [
                        sys.executable,
                        "-c",
                        run_from,
                        args.baseline,
                        *proxy_args(baseline_port),
                    ],
                ),
            )
            baseline_url = f"http://127.0.0.1:{baseline_port}"
            await wait_ready(baseline_url + "/health", ready_s)
            targets.append(("kvguard-baseline", baseline_url, baseline_proc.pid))

        router = router_binary(args.router_bin)
        if router is None or args.skip_router:
            print("vllm-router: not found or skipped (see the module docstring)")
        else:
            router_port = free_port()
            router_proc = procs.start(
                "vllm-router",
                traced(
                    "vllm-router",
                    [
                        router,
                        "--vllm-pd-disaggregation",
                        "--prefill",
                        prefill,
                        "--decode",
                        decode,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(router_port),
                        "--log-level",
                        "warning",
                    ],
                ),
            )
            router_url = f"http://127.0.0.1:{router_port}"
            await wait_ready(router_url + "/health", ready_s)
            targets.append(("vllm-router", router_url, router_proc.pid))

        for rnd in range(args.rounds):
            first = rnd % len(targets)
            order = targets[first:] + targets[:first]
            for stream in (False, True):
                mode = "stream" if stream else "non-stream"
                for name, url, pid in order:
                    result = await measure(
                        name, url, pid, stream, args, rnd, callgrind_out(name)
                    )
                    results.append(result)
                    cost = ""
                    if result.proxy_cpu_ms_per_req is not None:
                        cost = f"  proxy CPU {result.proxy_cpu_ms_per_req:.3f} ms/req"
                    if result.instructions_per_req is not None:
                        millions = result.instructions_per_req / 1e6
                        cost = f"  {millions:.3f} M instructions/req"
                    print(
                        f"r{rnd} {name:16s} {mode:10s} {result.rps:8.1f} req/s"
                        f"  p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms"
                        f"  errors {result.errors}/{result.requests}{cost}",
                        flush=True,
                    )
    finally:
        procs.stop_all()
        if not args.keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"logs in {logdir}")
    return results


def _spread(values: list[float]) -> str:
    """``values``' median and range, as ratios."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def ratios(results: list[Result]) -> list[str]:
    """KVGuard's proxy against each other target, per mode: each ratio taken
    within a round, printed as the median over rounds and its spread. A
    round where either target had errors gives no ratio."""
    by = {(r.target, r.mode, r.round): r for r in results}
    rounds = sorted({r.round for r in results})
    lines = []
    for mode in ("non-stream", "stream"):
        for other in ("kvguard-baseline", "vllm-router", "direct-decode"):
            pairs = [
                (by[("kvguard-proxy", mode, rnd)], by[(other, mode, rnd)])
                for rnd in rounds
                if ("kvguard-proxy", mode, rnd) in by and (other, mode, rnd) in by
            ]
            if not pairs:
                continue
            clean = [(p, b) for p, b in pairs if not (p.errors or b.errors) and b.rps]
            if not clean:
                lines.append(f"{mode:10s} vs {other}: errors, no ratio")
                continue
            parts = [
                f"{_spread([p.rps / b.rps for p, b in clean])} req/s",
                f"p50 {_spread([p.p50_ms / b.p50_ms for p, b in clean])}",
                f"p99 {_spread([p.p99_ms / b.p99_ms for p, b in clean])}",
            ]
            cpu = [
                p.proxy_cpu_ms_per_req / b.proxy_cpu_ms_per_req
                for p, b in clean
                if p.proxy_cpu_ms_per_req and b.proxy_cpu_ms_per_req
            ]
            if cpu:
                parts.append(f"CPU per request {_spread(cpu)}")
            instructions = [
                p.instructions_per_req / b.instructions_per_req
                for p, b in clean
                if p.instructions_per_req and b.instructions_per_req
            ]
            if instructions:  # under callgrind, times say nothing
                parts = [f"instructions per request {_spread(instructions)}"]
            skipped = len(pairs) - len(clean)
            note = f" ({skipped} round(s) with errors left out)" if skipped else ""
            lines.append(
                f"{mode:10s} kvguard-proxy / {other}, {len(clean)} rounds: "
                + ", ".join(parts)
                + note
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--requests", type=int, default=1000, help="per target, mode and round"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=6.0,
        help="seconds per target, mode and round",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=64, help="unmeasured requests before each"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--router-bin", default=None)
    parser.add_argument("--skip-router", action="store_true")
    parser.add_argument(
        "--proxy-log-level",
        default="warning",
        help="kvguard proxy log level (info logs one JSON line per attempt)",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run KVGuard's proxy from this checkout (another version)",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the proxies' instructions per request under callgrind "
        "(one round; needs valgrind)",
    )
    args = parser.parse_args(argv)
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        if not (Path(args.baseline) / "kvguard" / "cli.py").is_file():
            parser.error(f"--baseline {args.baseline}: no KVGuard checkout there")
    if args.instructions:
        if shutil.which("valgrind") is None:
            parser.error("--instructions needs valgrind (apt-get install valgrind)")
        args.rounds = 1
    print(
        f"bench_proxy: 1P1D fake engines, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, {args.rounds} rounds of <= "
        f"{args.requests} requests or {args.duration}s per target and mode, "
        f"{os.cpu_count()} CPUs"
    )
    try:
        import uvloop

        results = uvloop.run(run(args))
    except ImportError:
        results = asyncio.run(run(args))
    print()
    for line in ratios(results):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
