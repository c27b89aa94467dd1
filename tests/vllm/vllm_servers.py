"""Real vLLM servers (CPU, tiny local model) and KVGuard proxies for the
tests and benchmarks: started under ``timeout``, each in its own process
group (not session: see :func:`nice_busy_pollers`), on free ports, stopped
by PID. (What the tests send them: ``vllm_client``.)

:class:`Servers` keeps named vLLM instances up across tests and restarts
only those whose configuration a test changes (the machines have two cores:
the tests keep one producer and two consumers, only one of which works at a
time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp
from vllm_client import MODEL_NAME, REQUEST_TIMEOUT_S, complete

from tests.support import REPO
from tests.support.ports import free_port

# The Python of vLLM's environment (the tests' own by default).
VLLM_PYTHON = os.environ.get("KVGUARD_VLLM_PYTHON", sys.executable)
WORK_DIR = Path(os.environ.get("KVGUARD_VLLM_WORK", REPO / "build" / "vllm-test"))
MODEL_DIR = Path(os.environ.get("KVGUARD_TINY_MODEL", WORK_DIR / "tiny-llama"))

# Seconds a server may take to answer /health (about 40 on 2 cores).
STARTUP_TIMEOUT_S = float(os.environ.get("KVGUARD_VLLM_STARTUP_S", "360"))
# Seconds after which `timeout` kills a server whatever happens.
SERVER_LIFETIME_S = 1500
# How long the proxy may take to answer /health after its start.
PROXY_STARTUP_S = 120
# Seconds a killed process may take in the kernel's exit (state D) before
# a stop fails.
KERNEL_EXIT_S = 300
# Whether to lower NIXL's busy-polling threads (see nice_busy_pollers).
NICE_BUSY_POLLERS = os.environ.get("KVGUARD_VLLM_NICE_POLLERS", "1") != "0"
BLOCK_SIZE = 32
# 256 MiB of KV cache: thousands of the tiny model's 16 KiB blocks.
KV_CACHE_BYTES = 256 << 20
# ExampleConnector's KV on disk, per role (EngineSpec.multi_connector).
EXAMPLE_TIER_DIR = WORK_DIR / "example-tier"
MIDDLEWARE = "engine_patch.vllm.errors.kv_checksum_errors"
# The tiny models' tokenizer has no chat template of its own.
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
SCHEDULER_CLS = "engine_patch.vllm.scheduler.KVGuardScheduler"

# vLLM logs the first line as its worker creates a NIXL agent, NIXL the
# second about a second later. Once in many CI runs the UCX backend's
# creation between them stalled for minutes (4 min 48 s, on a consumer whose
# producer had started 4 s before); a start stalled there longer than
# NIXL_STALL_S is restarted once (see Servers.use).
NIXL_INIT_BEGIN = "Initializing NIXL wrapper"
NIXL_INIT_END = "Backend UCX was instantiated"
NIXL_STALL_S = 90.0
# Once a start's log was silent for minutes elsewhere (4 min 52 s, a
# connector-only consumer's engine core between its start and its
# connector's creation; its producer was up). A normal start's longest
# silence is under a minute: its imports, or a worker busy for minutes
# (building the fused checksum kernel, 129 s in CI) while vLLM's engine core
# logs each minute it waits. A start whose log is silent longer than
# START_SILENT_S is restarted once, like a NIXL stall.
START_SILENT_S = 150.0
# The warm-up request is an instance's first forward. A TP-2 instance's
# warm-up went unanswered in 5 of about 150 starts here with KVGuard (none of
# about 30 with plain NIXL): twice its engine core waited over a minute for
# its workers' reply to a step ("No available shared memory broadcast block"
# each minute), twice every process was idle when looked at. A warm-up
# unanswered for WARM_UP_STALL_S is a stalled start, restarted once, with
# where its threads wait in the startup summary.
WARM_UP_STALL_S = 90.0
# An instance of TP > 1 compiles on its first forward, in every rank, even
# with --enforce-eager: vLLM's VocabParallelEmbedding masks token ids with
# get_masked_input_and_mask, a torch.compile'd function (inductor, C++ built
# by g++). Uncached, on two loaded cores, that build alone went past 90 s
# (a stalled warm-up's threads: cc1plus, and the kernel's .cpp in the
# inductor cache written 85 s after the request), and a restart builds it
# again. Such an instance's warm-up gets this long.
WARM_UP_COMPILE_S = 300.0

# (server, seconds from launch to /health) of every start, for the summary.
STARTUPS: list[tuple[str, float]] = []


def ensure_model() -> Path:
    """The tiny model's folder, made by scripts/make_tiny_model.py if absent."""
    if not (MODEL_DIR / "model.safetensors").exists():
        subprocess.run(
            [VLLM_PYTHON, str(REPO / "scripts" / "make_tiny_model.py"), str(MODEL_DIR)],
            check=True,
            timeout=300,
        )
    return MODEL_DIR


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a ``/proc`` stat file after the command's name: state,
    parent, process group, ...

    Raises:
        OSError: If the process or thread is gone.
    """
    text = stat.read_text()
    return text[text.rindex(")") + 2 :].split()


def _group_pids(pgid: int) -> list[int]:
    """The processes of a process group."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if int(_stat_fields(entry / "stat")[2]) == pgid:
                    pids.append(int(entry.name))
    return pids


def _thread_states(pid: int) -> dict[int, str]:
    """The scheduler state (R, S, ...) of each thread of a process but its
    main one and those a library named (gloo's, ZMQ's, UCX's "async")."""
    states = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            if int(task.name) == pid:
                continue
            with contextlib.suppress(OSError):
                stat = (task / "stat").read_text()
                name, rest = stat.split("(", 1)[1].rsplit(")", 1)
                if name.startswith("VLLM::Worker"):
                    states[int(task.name)] = rest.split()[0]
    return states


def busy_threads(pgid: int, seconds: float = 1.0, samples: int = 20) -> list[int]:
    """The threads of a process group's vLLM workers (their main threads and
    named library threads aside) that never block: runnable (R) in every one
    of ``samples`` looks over ``seconds``, however little CPU a loaded
    machine leaves them."""
    workers = []
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                workers.append(pid)
    runnable: dict[int, int] = {}
    for _ in range(samples):
        for pid in workers:
            for tid, state in _thread_states(pid).items():
                runnable[tid] = runnable.get(tid, 0) + (state == "R")
        time.sleep(seconds / samples)
    return sorted(tid for tid, count in runnable.items() if count == samples)


def thread_waits(pgid: int) -> str:
    """Where a process group's threads wait, by thread name and kernel wait
    channel (``"VLLM::Worker_0/futex_wait_queue x3, ..."``), for the record
    of a stalled start."""
    waits: dict[str, int] = {}
    for pid in _group_pids(pgid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    name = (task / "comm").read_text().strip()
                    channel = (task / "wchan").read_text().strip() or "running"
                    key = f"{name}/{channel}"
                    waits[key] = waits.get(key, 0) + 1
    return ", ".join(f"{key} x{count}" for key, count in sorted(waits.items()))


def nice_busy_pollers(pgid: int) -> list[int]:
    """Lower to nice 19 the threads of an idle vLLM instance's workers that
    keep a core busy: NIXL's UCX progress thread.

    vLLM 0.32's NixlConnector starts NIXL agents with the progress thread on,
    and NIXL 1.5's Python API gives it no delay between polls: it spins,
    about 85% of a core per instance, idle or not. Two instances on a 2-core
    machine leave their engines a fraction of the CPU, and with any other
    load an engine step, hence a prefill or a proxy start, stalls for
    seconds up to ~30 s. At nice 19 the thread still polls whenever a core
    has nothing else to run. (vLLM's CPU guidance reserves a core for NIXL.)

    Nice values weigh threads against each other only within one
    scheduling autogroup, which Linux makes per session: the servers are
    therefore started in the caller's session (their own process group
    only). Each in a new session, four idle instances' pollers at nice 19
    still took four times the CPU of a starting instance's nice-0 threads.

    Returns:
        The thread ids lowered.
    """
    lowered = []
    for tid in busy_threads(pgid):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            lowered.append(tid)
    return lowered


PollerShare = Literal["nice", "full", "idle"]


def set_poller_share(tids: list[int], share: PollerShare) -> None:
    """Give busy pollers a share of the CPU: ``"nice"`` (nice 19, as
    :func:`nice_busy_pollers` left them), ``"full"`` (nice 0: a core's
    worth against the engines, as with a core of its own) or ``"idle"``
    (``SCHED_IDLE``: only what nothing else wants, below nice 19). A
    benchmark gives the pair it measures ``"full"`` and idles the rest, so
    that idle instances' pollers do not take the measured transfer's CPU."""
    for tid in tids:
        with contextlib.suppress(OSError):
            if share == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, 19 if share == "nice" else 0)


def _process_state(pid: int) -> str:
    """A process's scheduler state, process group and kernel wait channel."""
    try:
        fields = _stat_fields(Path(f"/proc/{pid}/stat"))
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "running"
    except OSError:
        return "no such process"
    return f"state {fields[0]}, process group {fields[2]}, waiting in {wchan}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM instance's P/D configuration.

    ``connector``: ``"nixl"`` (plain vLLM), ``"kvguard"`` or ``"faults"``
    (KVGuard with the fault injector, ``faults`` its settings).
    ``scheduler_class``: KVGuard's (same-step verdicts), or vLLM's own
    (connector-only); plain vLLM always runs vLLM's own. ``step_probe``: a
    subclass of that class counting engine steps (step_probe.py).
    """

    role: Literal["producer", "consumer"]
    connector: Literal["nixl", "kvguard", "faults"] = "kvguard"
    checksums: bool = True
    fail_closed: bool = True
    # None: KVGuard's default (eager on these CPUs), with no "compile" key.
    compile: bool | None = None
    policy: Literal["fail", "recompute"] = "fail"
    faults: tuple[tuple[str, Any], ...] = ()
    scheduler_class: bool = True
    step_probe: bool = False
    # Another model than the tiny llama (served under the llama's name, so
    # requests need no other), its block size, extra environment and
    # arguments.
    model: str | None = None
    block_size: int = BLOCK_SIZE
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    # KVGuard's inner connector: vLLM's MultiConnector of NIXL and a second
    # tier (ExampleConnector, on disk under WORK_DIR), as deployments that
    # pair NIXL with a KV cache tier (LMCache, offloading) configure it.
    multi_connector: bool = False
    # kv_role "kv_both" (as vLLM's NIXL examples and llm-d run every
    # instance), not the role's own.
    kv_both: bool = False

    @property
    def kv_role(self) -> str:
        return "kv_both" if self.kv_both else f"kv_{self.role}"

    @property
    def scheduler_cls(self) -> str | None:
        """The ``--scheduler-cls`` of the instance, if not vLLM's own."""
        kvguard = self.connector != "nixl" and self.scheduler_class
        if self.step_probe:
            return f"step_probe.StepProbe{'KVGuard' if kvguard else ''}Scheduler"
        return SCHEDULER_CLS if kvguard else None

    def kv_transfer_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "kv_role": self.kv_role,
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": self.policy,
        }
        if self.connector == "nixl":
            return {"kv_connector": "NixlConnector", **config}
        extra: dict[str, Any] = {
            "inner": self.inner_connector(),
            "kv_checksums": {
                "enabled": self.checksums,
                "fail_closed": self.fail_closed,
            },
        }
        if self.compile is not None:
            extra["kv_checksums"]["compile"] = self.compile
        name = "KVGuardConnector"
        if self.connector == "faults":
            name = "KVGuardFaultInjectionConnector"
            extra["fault_injection"] = dict(self.faults)
        return {
            "kv_connector": name,
            "kv_connector_module_path": "engine_patch.vllm",
            "kv_connector_extra_config": extra,
            **config,
        }

    def inner_connector(self) -> dict[str, Any]:
        """KVGuard's ``inner`` config."""
        if not self.multi_connector:
            return {"kv_connector": "NixlConnector"}
        # MultiConnector's children inherit nothing: each needs its role.
        role = self.kv_role
        tier = {"shared_storage_path": str(EXAMPLE_TIER_DIR / self.role)}
        return {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": "NixlConnector",
                        "kv_role": role,
                        "kv_buffer_device": "cpu",
                    },
                    {
                        "kv_connector": "ExampleConnector",
                        "kv_role": role,
                        "kv_connector_extra_config": tier,
                    },
                ]
            },
        }


class StartStalled(RuntimeError):
    """A server's start stalled where a fresh start does not (NIXL_STALL_S,
    START_SILENT_S)."""


@dataclass
class Server:
    """A process this module started, stopped by its PID."""

    name: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid_path(self) -> Path:
        """Where its PID is while it runs, for scripts/test_vllm.sh to stop
        it if the tests themselves are killed."""
        return WORK_DIR / "pids" / f"{self.name}.pid"

    def _launched(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.write_text(str(process.pid))

    def stop(self) -> None:
        """SIGTERM to its process group (its own session), SIGKILL to what is
        left of it after 30 s; returns once the whole group is gone (vLLM's
        engine processes hold the server's socket until they exit). A killed
        process still in the kernel's exit gets KERNEL_EXIT_S more.

        Raises:
            RuntimeError: If the process outlives all that (says what is left).
        """
        process, self.process = self.process, None
        if process is not None:
            _signal_group(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _group_alive(process.pid) and time.monotonic() < deadline:
                process.poll()
                time.sleep(0.2)
            killed = _group_alive(process.pid)
            if killed:
                _signal_group(process.pid, signal.SIGKILL)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired as e:
                state = _process_state(process.pid)
                if killed and state.startswith("state D"):
                    # Killed, and still in the kernel's teardown of its memory
                    # (seen in CI: over 30 s in unlink_file_vma_batch_process):
                    # it runs none of its code any more; the kernel's pace.
                    started = time.monotonic()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        process.wait(timeout=KERNEL_EXIT_S)
                    STARTUPS.append(
                        (
                            f"{self.name} stop: killed, then in the kernel ({state})",
                            30 + time.monotonic() - started,
                        )
                    )
                    if process.poll() is not None:
                        self.pid_path.unlink(missing_ok=True)
                        return
                raise RuntimeError(
                    f"{self.name} (pid {process.pid}) still running after "
                    f"{'SIGKILL' if killed else 'its group was gone'}: "
                    f"{_process_state(process.pid)}; group threads: "
                    f"{thread_waits(process.pid) or 'none'}"
                ) from e
        self.pid_path.unlink(missing_ok=True)

    def log_count(self, text: str) -> int:
        """How many lines of its log (this start's) hold ``text``."""
        try:
            with self.log_path.open(errors="replace") as log:
                return sum(text in line for line in log)
        except OSError:
            return 0

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class VllmServer(Server):
    """One vLLM OpenAI API server."""

    spec: EngineSpec | None = None
    starts: int = 0
    side_port: int = 0
    core: int = 0
    started_s: float = 0.0
    ready_s: float = 0.0
    # Busy-polling threads lowered to nice 19 (nice_busy_pollers).
    niced: list[int] = field(default_factory=list)
    # When this start's log first showed NIXL's agent creation pending.
    nixl_begun_s: float = 0.0
    # Why an earlier start of the same spec was abandoned, for the summary.
    restarted: str = ""
    # This start's log: its size when last seen to grow, and when.
    log_size: int = 0
    log_grew_s: float = 0.0
    # The longest the log was silent before this start was ready, for the
    # summary (the margin START_SILENT_S leaves).
    longest_silence_s: float = 0.0

    @property
    def tensor_parallel(self) -> int:
        """The instance's TP size (``--tensor-parallel-size`` in its args)."""
        args = list(self.spec.args) if self.spec is not None else []
        flag = "--tensor-parallel-size"
        return int(args[args.index(flag) + 1]) if flag in args else 1

    def start(
        self, spec: EngineSpec, kv_transfer_config: dict[str, Any] | None = None
    ) -> None:
        """Launch the server; ``kv_transfer_config`` overrides the spec's."""
        self.spec = spec
        if kv_transfer_config is None:
            kv_transfer_config = spec.kv_transfer_config()
        # Fresh ports and log for every start: a stopped server's port is
        # not reused while the kernel may still hold it.
        self.port, self.side_port = free_port(), free_port()
        self.starts += 1
        self.log_path = self.log_path.with_name(f"{self.name}-{self.starts}.log")
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "VLLM_CACHE_ROOT": str(WORK_DIR / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(WORK_DIR / "inductor"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
            # The step probe's module is beside this one.
            "PYTHONPATH": os.pathsep.join((str(REPO), str(Path(__file__).parent))),
            "PYTHONUNBUFFERED": "1",
            **dict(spec.env),
        }
        command = [
            "timeout", str(SERVER_LIFETIME_S),
            VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server",
            "--model", spec.model or str(ensure_model()),
            "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--max-model-len", "512",
            "--max-num-seqs", "4", "--block-size", str(spec.block_size),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--enforce-eager",
            "--chat-template", str(CHAT_TEMPLATE),
            "--kv-transfer-config", json.dumps(kv_transfer_config),
            *spec.args,
        ]  # fmt: skip
        if spec.connector != "nixl":
            command += ["--middleware", MIDDLEWARE]
        if spec.scheduler_cls is not None:
            command += ["--scheduler-cls", spec.scheduler_cls]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._launched(
                subprocess.Popen(
                    command,
                    cwd=WORK_DIR,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    process_group=0,
                )
            )
        self.started_s = time.monotonic()

    def nixl_stalled_s(self) -> float:
        """Seconds since this start's log first showed NIXL's agent being
        created without NIXL reporting its backend up (0 while not so)."""
        begun, ended = self.log_count(NIXL_INIT_BEGIN), self.log_count(NIXL_INIT_END)
        if begun <= ended:
            self.nixl_begun_s = 0.0
            return 0.0
        if not self.nixl_begun_s:
            self.nixl_begun_s = time.monotonic()
        return time.monotonic() - self.nixl_begun_s

    def log_silent_s(self) -> float:
        """Seconds since this start's log last grew (since the start while
        it has not)."""
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = 0
        now = time.monotonic()
        if size != self.log_size:
            self.log_size, self.log_grew_s = size, now
        silent = now - self.log_grew_s
        self.longest_silence_s = max(self.longest_silence_s, silent)
        return silent

    def check_log_not_silent(self) -> None:
        """A stalled start ends here: one whose log fell silent for minutes.

        Raises:
            StartStalled: If this start's log has been silent START_SILENT_S.
        """
        assert self.process is not None
        if self.log_silent_s() > START_SILENT_S:
            last = self.log_tail(1) or "(empty)"
            raise StartStalled(
                f"{self.name}: its log silent {START_SILENT_S:.0f} s at start,"
                f" after: {last!r} ({thread_waits(self.process.pid)})"
            )

    async def wait_exit(self, within_s: float) -> int:
        """Wait for a start that must fail (a refused config) to exit.

        Returns:
            Its exit code.

        Raises:
            StartStalled: If its log stays silent START_SILENT_S first, as a
                start that must succeed may (the same stall, before vLLM
                reaches the config).
            subprocess.TimeoutExpired: If it runs past ``within_s``.
        """
        assert self.process is not None
        deadline = self.started_s + within_s
        self.log_size, self.log_grew_s = 0, self.started_s
        while (code := self.process.poll()) is None:
            self.check_log_not_silent()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.process.args, within_s)
            await asyncio.sleep(1.0)
        return code

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        """Wait for /health, then warm the engine up with a local request.

        Raises:
            StartStalled: If NIXL's agent creation stalls (NIXL_STALL_S), the
                log stays silent (START_SILENT_S), or the warm-up gets no
                answer (WARM_UP_STALL_S).
            RuntimeError: If the server exits or is not up in time.
        """
        assert self.process is not None
        deadline = self.started_s + STARTUP_TIMEOUT_S
        self.nixl_begun_s = 0.0
        self.log_size, self.log_grew_s = 0, self.started_s
        self.longest_silence_s = 0.0
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}:\n"
                    + self.log_tail()
                )
            try:
                async with session.get(
                    f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as response:
                    if response.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            if self.nixl_stalled_s() > NIXL_STALL_S:
                raise StartStalled(
                    f"{self.name}: NIXL agent creation stalled {NIXL_STALL_S:.0f} s"
                    f" ({thread_waits(self.process.pid)})"
                )
            self.check_log_not_silent()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready:\n{self.log_tail()}")
            await asyncio.sleep(1.0)
        self.ready_s = time.monotonic() - self.started_s
        # Plain vLLM's CPU AMX attention crashes a process whose first forward
        # is a decode (see engine_patch/vllm/worker_side.py); a local request
        # first makes any instance safe, and the timings fair.
        limit_s = WARM_UP_COMPILE_S if self.tensor_parallel > 1 else WARM_UP_STALL_S
        try:
            async with asyncio.timeout(limit_s):
                status, _ = await complete(session, self.url, "warm up", max_tokens=2)
        except TimeoutError:
            raise StartStalled(
                f"{self.name}: its warm-up got no answer in {limit_s:.0f} s"
                f" ({thread_waits(self.process.pid)})"
            ) from None
        if status != 200:
            raise RuntimeError(f"{self.name} failed its warm-up:\n{self.log_tail()}")
        if NICE_BUSY_POLLERS and self.process is not None:
            self.niced = await asyncio.to_thread(nice_busy_pollers, self.process.pid)


@dataclass
class ProxyServer(Server):
    """The KVGuard proxy in front of one prefill and one decode."""

    launches: int = 0
    # What each failed /health probe of the last start saw.
    probes: list[str] = field(default_factory=list)

    def launch(self, prefill: str, decode: str) -> None:
        self.port = free_port()
        # A log per launch, kept for the run.
        self.launches += 1
        self.log_path = self.log_path.with_name(f"{self.name}-{self.launches}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Health probes patient enough for two cores shared with other work:
        # these tests are about KV loads, not about instances going away.
        config = {
            "server": {"host": "127.0.0.1", "port": self.port},
            "models": {
                "*": {
                    "prefill": {"instances": [{"url": prefill}]},
                    "decode": {"instances": [{"url": decode}]},
                }
            },
            "health": {"timeout_s": 15, "unhealthy_threshold": 4},
            "timeouts": {"prefill_s": REQUEST_TIMEOUT_S},
            # Room for a retry that load causes besides those the tests make.
            "retry": {"max_attempts": 5},
        }
        config_path = self.log_path.with_name(f"{self.name}.yaml")
        config_path.write_text(json.dumps(config))  # JSON is YAML.
        command = [
            "timeout", str(SERVER_LIFETIME_S),
            VLLM_PYTHON, "-m", "kvguard.cli", "proxy", "--config", str(config_path),
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            self._launched(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    process_group=0,
                )
            )

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        """Raises: RuntimeError: If the proxy is not up in time."""
        assert self.process is not None
        # Its first start imports from a fresh venv while two vLLM instances
        # keep both cores busy: seen to take over 30 s in CI-like runs.
        started = time.monotonic()
        deadline = started + PROXY_STARTUP_S
        self.probes = []
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            at = f"{time.monotonic() - started:.1f} s"
            try:
                async with session.get(
                    f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)
                ) as response:
                    if response.status == 200:
                        return
                    self.probes.append(f"{at}: HTTP {response.status}")
            except (aiohttp.ClientError, TimeoutError) as e:
                self.probes.append(f"{at}: {type(e).__name__}")
            await asyncio.sleep(0.2)
        state = "running" if self.process.poll() is None else "exited"
        raise RuntimeError(
            f"proxy not ready after {PROXY_STARTUP_S} s ({state}); probes "
            f"{self.probes[-5:]}:\n{self.log_tail()}"
        )


@dataclass
class Servers:
    """Named vLLM instances and KVGuard proxies, kept up across tests."""

    session: aiohttp.ClientSession
    engines: dict[str, VllmServer] = field(default_factory=dict)
    proxies: dict[str, ProxyServer] = field(default_factory=dict)

    def engine(self, name: str) -> VllmServer:
        return self.engines[name]

    def proxy(self, name: str) -> ProxyServer:
        return self.proxies[name]

    async def use(
        self,
        specs: Mapping[str, EngineSpec],
        proxies: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        """Make the named instances run these specs (restarting only what
        changed, all at once; others are left as they are), and start fresh
        proxies, each in front of a (prefill, decode) pair of them.

        Producers use core 0, consumers core 1.
        """
        proxies = proxies or {}
        changed = []
        for name, spec in specs.items():
            server = self.engines.get(name)
            if server is None:
                logs = WORK_DIR / "logs"
                server = VllmServer(
                    name,
                    0,
                    logs / f"{name}.log",
                    core=0 if spec.role == "producer" else 1,
                )
                self.engines[name] = server
            if server.process is None or server.spec != spec:
                changed.append((server, spec))
        for name in proxies:
            if name in self.proxies:
                self.proxies[name].stop()
        for server, _ in changed:
            server.stop()
        for server, spec in changed:
            server.start(spec)
        await asyncio.gather(*(self._ready(server, spec) for server, spec in changed))
        for server, spec in changed:
            niced = (
                f" [nice 19: {', '.join(f'thread {tid}' for tid in server.niced)}]"
                if server.niced
                else ""
            )
            restarted = f" [restarted: {server.restarted}]" if server.restarted else ""
            silence = f" [log silent at most {server.longest_silence_s:.0f} s]"
            STARTUPS.append(
                (
                    f"{server.name} ({spec.connector}){niced}{restarted}{silence}",
                    server.ready_s,
                )
            )
        for name, (prefill, decode) in proxies.items():
            await self._start_proxy(name, prefill, decode)

    async def _ready(self, server: VllmServer, spec: EngineSpec) -> None:
        """Wait for a started server; one whose start stalled is started
        again, once."""
        server.restarted = ""
        try:
            await server.wait_ready(self.session)
        except StartStalled as stalled:
            server.restarted = str(stalled)
            await asyncio.to_thread(server.stop)
            server.start(spec)
            await server.wait_ready(self.session)

    async def _start_proxy(self, name: str, prefill: str, decode: str) -> None:
        proxy = self.proxies.get(name)
        if proxy is None:
            proxy = ProxyServer(name, 0, WORK_DIR / "logs" / f"{name}.log")
            self.proxies[name] = proxy
        started = time.monotonic()
        proxy.launch(self.engines[prefill].url, self.engines[decode].url)
        await proxy.wait_ready(self.session)
        seconds = time.monotonic() - started
        # A slow start names its log and what the last probes saw.
        slow = f" [{proxy.log_path.name}: {proxy.probes[-3:]}]"
        STARTUPS.append((f"{name}{slow if seconds > 10 else ''}", seconds))

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        for server in self.engines.values():
            server.stop()
