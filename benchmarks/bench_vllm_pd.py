"""Cost of KVGuard in real vLLM 0.32 (CPU, tiny model): P/D latency of
three phases against each other, in the same run, and the scheduler-side
cost per request.

Phases, each a producer and a consumer instance (started a pair at a
time, then all six up, so that every phase sees the same machine):

- ``off``: plain NixlConnector on both;
- ``on``: KVGuardConnector (fail-closed) around it, the connector only;
- ``on+scheduler``: the same with KVGuard's scheduler class
  (``--scheduler-cls``: same-step verdicts);
- ``on+scheduler+compiled`` (only if named in ``--phases``): the same with
  the fused checksum kernel (``"compile": true``);
- ``on+scheduler+unchecked`` (only if named in ``--phases``): KVGuard's
  connector and scheduler class with checksums off (``"enabled": false``):
  what the wrapping costs without the checksums.

After ``--warmup-rounds`` unmeasured rounds (so that every phase has seen
every prompt length once: an engine's first prefill of a length is slow),
each of ``--rounds`` rounds sends every prompt to every phase, one P/D
request at a time straight to the engines, the phases' order rotating from
prompt to prompt. Each round starts the prompts with its number, so that no
engine prefills from its prefix cache a prompt an earlier round sent.
Measured: the prefill's latency
(max_tokens 1), the decode's time to first token (streamed: the KV load and
its verification included) and its total time. Printed: per phase, medians
and p90 over all rounds, each as a ratio to ``off`` (the median of the
rounds' ratios, with their spread), the median of the per-prompt ratios to
the same prompt in ``off`` (with their quartiles), the engine steps between
a load finishing and its first token (every consumer runs its scheduler class
with a step-counting subclass, ``tests/vllm/step_probe.py``), the share of
decodes in the slow mode (below), KVGuard's own time per request
(scheduler-side, worker checksums, loads held) and each round's medians.

    .venv-vllm/bin/python benchmarks/bench_vllm_pd.py [--requests 40]
        [--rounds 5] [--phases off,on,on+scheduler] [--pollers nice|focus]
        [--out result.json]
    .venv-vllm/bin/python benchmarks/bench_vllm_pd.py --scheduler-cost
        [--per-step 1,16] [--chunk-tokens 2048]
    .venv-vllm/bin/python benchmarks/bench_vllm_pd.py --scheduler-breakdown
        [--per-step 1,16] [--chunk-tokens 2048]

``--scheduler-cost`` needs no servers: it steps vLLM's real scheduler with
KVGuard in process (tests/vllm/engine_steps.py) through producer and
consumer requests of several sizes and prints the scheduler-side time per
request from KVGuard's stats (``scheduler_seconds``), fitted as a fixed
cost plus a cost per block, with one request per engine step (the worst
case) and with several going through the same steps (``--per-step``), for
producers' prompts prefilled whole and in chunks (``--chunk-tokens``, as
vLLM's chunked prefill takes every long prompt), and the time an idle engine
step spends in KVGuard's connector.
``--scheduler-breakdown`` splits that time call by call, for 64-block
requests.

NIXL's progress threads spin (``docs/vllm.md``, "Cores and NIXL's progress
thread"); the harness runs them at nice 19, where a decode waits 80-600 ms
for its KV whenever the producer's poller gets too little of the cores
(``--pollers nice``, the default, as in the tests). ``--pollers focus``
gives, for each request, the measured pair's pollers nice 0 (as if each had
a core, vLLM's advice for production) and every other instance's
``SCHED_IDLE``, the same for every phase. A decode whose TTFT is over twice
its phase's 25th percentile is counted in the slow mode: a quarter to a
third of them under ``nice``, a few percent under ``focus``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "vllm"
# The servers and client helpers live with the real-vLLM tests, and import
# tests.support from the repository root.
sys.path[:0] = [str(TESTS), str(ROOT)]

from vllm_client import MODEL_NAME, complete, metrics, prompts  # noqa: E402
from vllm_servers import (  # noqa: E402
    STARTUPS,
    EngineSpec,
    PollerShare,
    Servers,
    ensure_model,
    set_poller_share,
)

DECODE_TOKENS = 16
PHASES = ("off", "on", "on+scheduler")
KEYS = ("prefill_s", "decode_ttft_s", "decode_s")
# KVGuard's own times in a phase's summary (``per_request``).
OWN_KEY = re.compile(r"(producer|consumer)_")
# A decode whose TTFT exceeds this many times its phase's 25th percentile is
# in the slow mode: it waited for a starved NIXL poller (docs/vllm.md,
# "Cores and NIXL's progress thread"), whatever the connector.
SLOW_DECODE_FACTOR = 2.0


def phase_specs(phase: str) -> tuple[EngineSpec, EngineSpec]:
    """The phase's producer and consumer."""
    if phase == "off":
        specs = EngineSpec("producer", "nixl"), EngineSpec("consumer", "nixl")
    elif phase == "on":
        specs = (
            EngineSpec("producer", scheduler_class=False),
            EngineSpec("consumer", scheduler_class=False),
        )
    elif phase == "on+scheduler":
        specs = EngineSpec("producer"), EngineSpec("consumer")
    elif phase == "on+scheduler+compiled":
        specs = (
            EngineSpec("producer", compile=True),
            EngineSpec("consumer", compile=True),
        )
    elif phase == "on+scheduler+unchecked":
        specs = (
            EngineSpec("producer", checksums=False),
            EngineSpec("consumer", checksums=False),
        )
    else:
        raise SystemExit(f"unknown phase {phase}")
    producer, consumer = specs
    return producer, replace(consumer, step_probe=True)


async def pd_request(
    http: aiohttp.ClientSession, servers: Servers, phase: str, prompt: str, rid: str
) -> dict[str, float]:
    """One P/D request; its prefill, decode-TTFT and decode times."""
    producer = servers.engine(f"{phase}-producer").url
    consumer = servers.engine(f"{phase}-consumer").url
    start = time.perf_counter()
    status, answer = await complete(
        http,
        producer,
        prompt,
        max_tokens=1,
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    prefill_s = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"{phase} prefill failed: {answer}")
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": DECODE_TOKENS,
        "temperature": 0,
        "stream": True,
        "kv_transfer_params": answer["kv_transfer_params"],
    }
    start = time.perf_counter()
    first = None
    async with http.post(
        f"{consumer}/v1/completions", json=body, headers={"X-Request-Id": rid}
    ) as response:
        if response.status != 200:
            raise RuntimeError(f"{phase} decode failed: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data:") and b'"text"' in line and first is None:
                first = time.perf_counter() - start
            if b'"error"' in line:
                raise RuntimeError(f"{phase} decode failed: {line!r}")
    total = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_ttft_s": first or total, "decode_s": total}


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def slow_share(ttfts: list[float]) -> float:
    """The share of decodes in the slow mode (``SLOW_DECODE_FACTOR``): how
    much of a phase's decode TTFT is the pollers' doing, which moves its
    median by several percent from run to run."""
    if len(ttfts) < 2:
        return 0.0
    threshold = SLOW_DECODE_FACTOR * statistics.quantiles(ttfts, n=4)[0]
    return sum(t > threshold for t in ttfts) / len(ttfts)


async def kvguard_stats(
    http: aiohttp.ClientSession, servers: Servers, phase: str
) -> dict[str, dict[str, float]]:
    return {
        side: await metrics(http, servers.engine(f"{phase}-{side}").url)
        for side in ("producer", "consumer")
    }


def per_request(
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    count: int,
) -> dict[str, float]:
    """KVGuard's own time per request between two snapshots of a phase."""
    result: dict[str, float] = {}
    for side in ("producer", "consumer"):

        def delta(name: str, side: str = side) -> float:
            key = f"kvguard_kv_{name}_total"
            return after[side].get(key, 0.0) - before[side].get(key, 0.0)

        if scheduler := delta("checksum_scheduler_seconds"):
            result[f"{side}_scheduler_us"] = scheduler / count * 1e6
        if checksum := delta("checksum_seconds"):
            result[f"{side}_checksum_ms"] = checksum / count * 1e3
        if held := delta("loads_held"):
            result["consumer_hold_ms_per_load"] = (
                delta("load_hold_seconds") / held * 1e3
            )
    return result


def focus_pollers(servers: Servers, phases: list[str], measured: str) -> None:
    """The measured pair's NIXL pollers at nice 0, as with a core of their
    own, every other instance's idle (``--pollers focus``): what is left of
    two cores then goes to the pair being measured, whichever phase it is."""
    for phase in phases:
        share: PollerShare = "full" if phase == measured else "idle"
        for side in ("producer", "consumer"):
            set_poller_share(servers.engine(f"{phase}-{side}").niced, share)


def probe_steps(servers: Servers, phase: str) -> list[int]:
    """The step probe's counts logged by the phase's consumer so far."""
    log = servers.engine(f"{phase}-consumer").log_path
    pattern = re.compile(r"KVGuard step probe: request \S+ first token (\d+) steps")
    return [int(m[1]) for m in pattern.finditer(log.read_text(errors="replace"))]


def labelled(prompt: str, round_number: int) -> str:
    """``prompt`` as sent in round ``round_number``, warm-up rounds included.

    The label makes the prompt new to every engine's prefix cache (a prompt an
    engine has seen would prefill from it). Its number has a fixed width, for
    an engine's first prefill of a prompt length is slow (docs/vllm.md) and
    the tiny model's tokenizer takes a token per digit: "Round 10." is a
    token longer than "Round 9.".
    """
    return f"Round {round_number:03d}. {prompt}"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    phases = args.phases.split(",")
    measured = prompts(args.requests, seed=7, words=(170, 180))
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        servers = Servers(http)
        try:
            # A pair at a time: six vLLM instances starting at once on two
            # cores take longer each than a start may.
            for phase in phases:
                producer, consumer = phase_specs(phase)
                await servers.use(
                    {f"{phase}-producer": producer, f"{phase}-consumer": consumer}
                )
            # Every prompt length the rounds send, seen once by every phase.
            for w in range(args.warmup_rounds):
                for i, prompt in enumerate(measured):
                    for phase in phases:
                        text = labelled(prompt, w)
                        await pd_request(
                            http, servers, phase, text, f"{phase}-w{w}-{i}"
                        )
            steps_before = {phase: len(probe_steps(servers, phase)) for phase in phases}
            samples: dict[str, list[list[dict[str, float]]]] = {p: [] for p in phases}
            own: dict[str, list[dict[str, float]]] = {p: [] for p in phases}
            for r in range(args.rounds):
                before = {p: await kvguard_stats(http, servers, p) for p in phases}
                for p in phases:
                    samples[p].append([])
                for i, prompt in enumerate(measured):
                    text = labelled(prompt, args.warmup_rounds + r)
                    shift = (i + r) % len(phases)
                    for phase in phases[shift:] + phases[:shift]:
                        if args.pollers == "focus":
                            focus_pollers(servers, phases, phase)
                        rid = f"{phase}-r{r}-{i}-{time.time_ns()}"
                        sample = await pd_request(http, servers, phase, text, rid)
                        samples[phase][r].append(sample)
                for p in phases:
                    after = await kvguard_stats(http, servers, p)
                    own[p].append(per_request(before[p], after, len(measured)))
                print(
                    f"round {r + 1}:",
                    json.dumps(
                        {
                            p: {
                                k: round(
                                    statistics.median(s[k] for s in samples[p][r])
                                    * 1e3,
                                    1,
                                )
                                for k in KEYS
                            }
                            for p in phases
                        }
                    ),
                    flush=True,
                )
            steps = {p: probe_steps(servers, p)[steps_before[p] :] for p in phases}
        except BaseException:
            servers.stop()
            raise
        try:
            servers.stop()
        except RuntimeError as e:
            # An engine the kernel has not let go of yet (killed, in state D):
            # the measurements stand.
            print(f"warning: {e}", file=sys.stderr)
    return summarize(phases, samples, own, steps)


def summarize(
    phases: list[str],
    samples: dict[str, list[list[dict[str, float]]]],
    own: dict[str, list[dict[str, float]]],
    steps: dict[str, list[int]],
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for phase in phases:
        rounds = samples[phase]
        values = {k: [s[k] for r in rounds for s in r] for k in KEYS}
        entry: dict[str, Any] = {
            f"{k}_median_ms": statistics.median(values[k]) * 1e3 for k in KEYS
        }
        entry |= {f"{k}_p90_ms": p90(values[k]) * 1e3 for k in KEYS}
        if phase != "off" and "off" in samples:
            for k in KEYS:
                for stat, fn in (("median", statistics.median), ("p90", p90)):
                    ratios = [
                        fn([s[k] for s in mine]) / fn([s[k] for s in base])
                        for mine, base in zip(rounds, samples["off"], strict=True)
                    ]
                    entry[f"{k}_{stat}_ratio"] = statistics.median(ratios)
                    entry[f"{k}_{stat}_ratio_spread"] = [min(ratios), max(ratios)]
                # Each prompt against itself in off, sent moments apart: the
                # prompts' own spread (length, cache placement) cancels out.
                paired = [
                    mine[k] / base[k]
                    for mine_round, base_round in zip(
                        rounds, samples["off"], strict=True
                    )
                    for mine, base in zip(mine_round, base_round, strict=True)
                ]
                quartiles = statistics.quantiles(paired, n=4)
                entry[f"{k}_paired_ratio"] = quartiles[1]
                entry[f"{k}_paired_ratio_quartiles"] = [quartiles[0], quartiles[2]]
        entry["decode_slow_share"] = slow_share(values["decode_ttft_s"])
        entry["steps_load_to_first_token"] = dict(
            sorted({n: steps[phase].count(n) for n in set(steps[phase])}.items())
        )
        mine = own[phase]
        for key in sorted({k for r in mine for k in r}):
            entry[key] = statistics.median(r.get(key, 0.0) for r in mine)
        entry["round_medians_ms"] = [
            {k: statistics.median(s[k] for s in r) * 1e3 for k in KEYS} for r in rounds
        ]
        entry["samples_ms"] = [
            [{k: s[k] * 1e3 for k in KEYS} for s in r] for r in rounds
        ]
        summary[phase] = entry
    summary["startup_s"] = [[name, round(seconds, 1)] for name, seconds in STARTUPS]
    return summary


def combine(paths: list[Path]) -> tuple[dict[str, Any], list[str]]:
    """Several runs' ``--out`` summaries as one run of all their rounds, and
    its phases: one run's round medians move by several percent, so runs
    of the same code are pooled before a ratio is read against a goal.
    The phases pooled are those every run measured (each run's against its
    own ``off``); KVGuard's own times are the median of the runs' medians.

    Raises:
        ValueError: If the runs have no phase but ``off`` in common.
    """
    runs = [json.loads(path.read_text()) for path in paths]
    phases = [
        phase
        for phase in runs[0]
        if phase != "startup_s" and all(phase in summary for summary in runs)
    ]
    if "off" not in phases or len(phases) < 2:
        raise ValueError(f"{', '.join(map(str, paths))} share no phase but off")
    samples = {
        phase: [
            [{k: s[k] / 1e3 for k in KEYS} for s in samples_of_round]
            for summary in runs
            for samples_of_round in summary[phase]["samples_ms"]
        ]
        for phase in phases
    }
    own = {
        phase: [
            {k: v for k, v in summary[phase].items() if OWN_KEY.match(k)}
            for summary in runs
        ]
        for phase in phases
    }
    steps = {
        phase: [
            int(n)
            for summary in runs
            for n, count in summary[phase]["steps_load_to_first_token"].items()
            for _ in range(count)
        ]
        for phase in phases
    }
    return summarize(phases, samples, own, steps), phases


def print_table(summary: dict[str, Any], phases: list[str]) -> None:
    names = {
        "prefill_s": "prefill",
        "decode_ttft_s": "decode TTFT",
        "decode_s": "decode total",
    }
    print(f"{'phase':<14}{'metric':<14}{'median ms':>10}{'ratio':>8}{'spread':>16}"
          f"{'p90 ms':>10}{'ratio':>8}{'spread':>16}")  # fmt: skip
    for phase in phases:
        entry = summary[phase]
        for k in KEYS:
            cells = [f"{entry[f'{k}_median_ms']:.1f}"]
            line = f"{phase:<14}{names[k]:<14}{cells[0]:>10}"
            for stat in ("median", "p90"):
                if stat == "p90":
                    line += f"{entry[f'{k}_p90_ms']:>10.1f}"
                ratio = entry.get(f"{k}_{stat}_ratio")
                if ratio is None:
                    line += f"{'':>8}{'':>16}"
                else:
                    lo, hi = entry[f"{k}_{stat}_ratio_spread"]
                    line += f"{ratio:>8.3f}{f'[{lo:.2f}, {hi:.2f}]':>16}"
            print(line)
        if "prefill_s_paired_ratio" in entry:
            paired = ", ".join(
                f"{names[k]} {entry[f'{k}_paired_ratio']:.3f} "
                f"[{entry[f'{k}_paired_ratio_quartiles'][0]:.2f}, "
                f"{entry[f'{k}_paired_ratio_quartiles'][1]:.2f}]"
                for k in KEYS
            )
            print(f"{'':<14}paired with off, per prompt (median [p25, p75]): {paired}")
        print(f"{'':<14}steps from load finished to first token: "
              f"{entry['steps_load_to_first_token']}")  # fmt: skip
        print(f"{'':<14}decodes in the slow mode (TTFT over "
              f"{SLOW_DECODE_FACTOR:g}x the phase's p25): "
              f"{entry['decode_slow_share']:.0%}")  # fmt: skip


# ------------------------------------------------------------ scheduler cost


class SchedulerFlow(NamedTuple):
    """Requests of one kind taken through vLLM's scheduler together."""

    name: str
    # "producer" or "consumer".
    role: str
    # An engine_steps flow: (scheduler, req_ids, num_tokens, kvguard=...).
    flow: Callable[..., dict[str, Any]]
    # A prefill's tokens per step and request (chunked prefill), or None
    # for whole prompts.
    chunk_tokens: int | None = None


def _warm_scheduler(
    flow: SchedulerFlow,
    blocks: int,
    per_step: int = 1,
    plain: bool = False,
) -> tuple[Any, int]:
    """vLLM's real scheduler with KVGuard's class (``plain``: vLLM's own
    class around plain NIXL) for ``flow``'s requests of ``blocks`` blocks
    (16 tokens each, the last half full), ``per_step`` of them in the same
    steps, after ten warm-up runs of it, with its heap frozen; and the
    tokens per request. The caller unfreezes the heap when done."""
    import engine_steps as es
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine_patch.vllm.scheduler import KVGuardScheduler

    block_size = 16
    num_tokens = blocks * block_size - block_size // 2
    config = es.vllm_config(
        f"kv_{flow.role}",
        block_size=block_size,
        max_model_len=max(num_tokens + block_size, 512),
        num_blocks=blocks * 4 * per_step + 64,
        prompts_per_step=per_step,
        **({"connector": "NixlConnector"} if plain else {}),
    )
    if flow.chunk_tokens:
        # Each request's prompt in chunks of chunk_tokens, all in each step.
        config.scheduler_config.max_num_batched_tokens = flow.chunk_tokens * per_step
        config.scheduler_config.long_prefill_token_threshold = flow.chunk_tokens
    scheduler = es.make_scheduler(Scheduler if plain else KVGuardScheduler, config)
    for i in range(10):
        flow.flow(
            scheduler,
            [f"warm-{i}-{j}" for j in range(per_step)],
            num_tokens,
            kvguard=not plain,
        )
    # As vLLM's engine does after startup: a long-lived heap is not walked
    # by every collection.
    gc.collect()
    gc.freeze()
    return scheduler, num_tokens


def _clock_engine_calls(scheduler: Any) -> list[float]:
    """Time the scheduler's ``schedule`` and ``update_from_output`` calls (an
    engine step's scheduler work) from now on: their seconds so far, in a
    one-item list the caller may reset."""
    seconds = [0.0]
    for name in ("schedule", "update_from_output"):
        method = getattr(scheduler, name)

        def clocked(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[0] += time.perf_counter() - start

        setattr(scheduler, name, clocked)
    return seconds


def _scheduler_flows(chunk_tokens: int | None) -> list[SchedulerFlow]:
    """The engine_steps flows that take each role's requests through the
    scheduler together; with ``chunk_tokens``, producers' prompts in chunks
    of that many tokens too (every long prompt is chunked)."""
    import engine_steps as es

    flows = [
        SchedulerFlow("producer", "producer", es.produce_together),
        SchedulerFlow("consumer", "consumer", es.consume_together),
    ]
    if chunk_tokens:
        flows.append(
            SchedulerFlow(
                "producer, chunked",
                "producer",
                functools.partial(es.produce_together, chunk_tokens=chunk_tokens),
                chunk_tokens,
            )
        )
    return flows


def _batch_summary(
    per_batch: list[tuple[float, float, float]],
) -> tuple[float, float, float, float, float]:
    """Of batches' (KVGuard's own, vLLM's step calls with KVGuard, with
    plain NIXL) seconds per request: the best and median own, the best step
    calls both ways, and the median ratio of the step calls."""
    own = [o for o, _, _ in per_batch]
    return (
        min(own),
        statistics.median(own),
        min(steps for _, steps, _ in per_batch),
        min(base for _, _, base in per_batch),
        statistics.median(steps / base for _, steps, base in per_batch),
    )


def _run_requests(
    scheduler: Any,
    flow: SchedulerFlow,
    num_tokens: int,
    per_step: int,
    runs: int,
    prefix: str,
    kvguard: bool = True,
) -> float:
    """KVGuard's scheduler-side seconds (``scheduler_seconds``) over ``runs``
    runs of ``flow``, each taking ``per_step`` new requests through the same
    steps; without ``kvguard`` (plain NIXL's scheduler), 0.0.

    Raises:
        RuntimeError: If KVGuard did not send (producer) or verify
            (consumer) the checksums of every request of a run: the time
            measured must be theirs.
    """
    outcome = "sent" if flow.role == "producer" else "verified"
    seconds = 0.0
    for i in range(runs):
        req_ids = [f"{prefix}-{i}-{j}" for j in range(per_step)]
        counts = flow.flow(scheduler, req_ids, num_tokens, kvguard=kvguard)
        if kvguard and counts.get(outcome, 0) != per_step:
            raise RuntimeError(
                f"{flow.name}: {outcome} {counts.get(outcome, 0)} of {per_step}"
            )
        seconds += counts.get("scheduler_seconds", 0.0)
    return seconds


def scheduler_cost(
    block_counts: list[int],
    per_steps: list[int],
    requests: int,
    batches: int,
    chunk_tokens: int | None = None,
) -> None:
    """KVGuard's scheduler-side time per producer and consumer request (its
    stats' ``scheduler_seconds``), in vLLM's real scheduler, with each of
    ``per_steps`` requests going through the same steps, and its share of an
    idle engine step.

    One request per step is the worst case: every step's fixed work (the
    workers' metadata, their output, the stats) falls on it alone. Under
    load a step carries many requests' prefills, loads and finishes, and
    that work is shared.

    The baseline, in the same batches: vLLM's own step calls (``schedule``
    and ``update_from_output``) per request with KVGuard and with plain
    NIXL. Their difference is all KVGuard adds to the scheduler, its
    connector's delegation and the collections its objects bring included,
    which ``scheduler_seconds`` (KVGuard's own calls) leaves out.

    Every batch runs twice, with Python's cyclic collector and without it
    (collecting after the batch). A collection falls in whichever call
    allocates when the collector's count runs over, and then walks vLLM's
    young objects (a 2048-block prompt's token lists hold 32,760 ints): in
    KVGuard's calls it made a batch's time up to 8 times its best. The fit
    uses the time without collections, KVGuard's own work.
    """
    import engine_steps as es
    from vllm.v1.outputs import KVConnectorOutput

    from engine_patch.vllm import KVGuardConnector
    from engine_patch.vllm.scheduler import KVGuardScheduler

    for per_step in per_steps:
        fits: dict[str, list[tuple[int, float]]] = {}
        for flow in _scheduler_flows(chunk_tokens):
            for blocks in block_counts:
                scheduler, num_tokens = _warm_scheduler(flow, blocks, per_step)
                plain, _ = _warm_scheduler(flow, blocks, per_step, plain=True)
                clocks = _clock_engine_calls(scheduler), _clock_engine_calls(plain)
                runs = max(1, requests // per_step)
                num_requests = runs * per_step
                # Per batch, with collections and without: KVGuard's
                # scheduler_seconds, then vLLM's step calls with KVGuard and
                # with plain NIXL, alternating.
                per_batch: dict[bool, list[tuple[float, float, float]]] = {
                    True: [],
                    False: [],
                }
                for b in range(batches):
                    for collecting in (True, False):
                        clocks[0][0] = clocks[1][0] = 0.0
                        if not collecting:
                            gc.disable()
                        try:
                            _run_requests(
                                plain,
                                flow,
                                num_tokens,
                                per_step,
                                runs,
                                f"p{b}{collecting:d}",
                                False,
                            )
                            kvguard = _run_requests(
                                scheduler,
                                flow,
                                num_tokens,
                                per_step,
                                runs,
                                f"r{b}{collecting:d}",
                            )
                        finally:
                            gc.enable()
                        per_batch[collecting].append(
                            (
                                kvguard / num_requests,
                                clocks[0][0] / num_requests,
                                clocks[1][0] / num_requests,
                            )
                        )
                gc.unfreeze()
                best, median, steps, base, ratio = _batch_summary(per_batch[False])
                _, median_gc, _, _, ratio_gc = _batch_summary(per_batch[True])
                fits.setdefault(flow.name, []).append((blocks, best))
                print(
                    f"{flow.name:<9} {blocks:>6} blocks, {per_step:>2} per step: "
                    f"{best * 1e6:8.1f} us/request without collections "
                    f"(best of {batches} batches; median {median * 1e6:.1f}), "
                    f"median {median_gc * 1e6:.1f} with; "
                    f"vLLM's step calls {steps * 1e6:.1f} us/request, "
                    f"{base * 1e6:.1f} with plain NIXL "
                    f"(x{ratio:.2f} without collections, x{ratio_gc:.2f} with)",
                    flush=True,
                )
        for role, points in fits.items():
            xs = [float(b) for b, _ in points]
            ys = [s for _, s in points]
            mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
            slope = sum(
                (x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)
            )
            slope /= sum((x - mean_x) ** 2 for x in xs)
            print(
                f"{role}, {per_step} per step: "
                f"{(mean_y - slope * mean_x) * 1e6:.1f} us + "
                f"{slope * 1e9:.1f} ns per block without collections "
                "(goal: <= 50 us + 20 ns per block)"
            )

    def idle_calls(connector: Any, scheduler_output: Any) -> Callable[[], None]:
        def calls() -> None:
            output = KVConnectorOutput()
            connector.build_connector_meta(scheduler_output)
            if hasattr(connector, "verify_finished_loads"):
                connector.verify_finished_loads(output)
            connector.update_connector_output(output)
            connector.get_kv_connector_stats()

        return calls

    # A finished producer request whose blocks NIXL holds: the engine steps
    # idly, each step calling the connector.
    scheduler = es.make_scheduler(KVGuardScheduler, es.vllm_config("kv_producer"))
    scheduler.add_request(es.request("held", 200, {"do_remote_decode": True}, 1))
    es.step(scheduler, es.Workers(checksums={"held": es.block_checksums(200)}))
    assert scheduler.has_requests()
    output = scheduler.schedule()
    kvguard = scheduler.connector
    assert isinstance(kvguard, KVGuardConnector)
    timings = {}
    for name, connector in (("kvguard", kvguard), ("nixl", kvguard.inner)):
        calls = idle_calls(connector, output)
        runs = []
        for _ in range(batches * 4):
            start = time.perf_counter()
            for _ in range(2000):
                calls()
            runs.append((time.perf_counter() - start) / 2000)
        timings[name] = min(runs)
    print(
        f"idle step: KVGuardConnector's calls {timings['kvguard'] * 1e6:.2f} us, "
        f"NixlConnector's alone {timings['nixl'] * 1e6:.2f} us: KVGuard adds "
        f"{(timings['kvguard'] - timings['nixl']) * 1e6:.2f} us per idle step"
    )


# The scheduler-side calls --scheduler-breakdown times, by module and
# class; nested ones are included in their callers' times.
BREAKDOWN = {
    "engine_patch.vllm.scheduler_side.KVGuardSchedulerSide": [
        "_on_new_request",
        "_on_alloc",
        "_build_meta",
        "_take_output",
        "_flush",
        "take_stats",
    ],
    "engine_patch.scheduler.KVChecksumScheduler": [
        "add_send",
        "add_recv",
        "_blocks",
        "update_from_output",
        "_take_record",
        "_verify",
        "request_finished",
    ],
    "engine_patch.verify.KVChecksumComparer": ["compare", "payload"],
    "engine_patch.verify.PendingChecksums": ["set_expected"],
}


def scheduler_breakdown(
    blocks: int, per_steps: list[int], requests: int, chunk_tokens: int | None = None
) -> None:
    """Where KVGuard's scheduler-side time per request goes, call by call,
    inside vLLM's scheduler, with each of ``per_steps`` requests going
    through the same steps, without Python's cyclic collector: each call's
    total per request and per call (nested calls included in their
    callers')."""
    import importlib

    totals: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
                calls[name] = calls.get(name, 0) + 1

        return call

    originals = []
    for path, names in BREAKDOWN.items():
        module, class_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), class_name)
        for name in names:
            originals.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, timed(f"{class_name}.{name}", cls.__dict__[name]))
    try:
        for per_step in per_steps:
            for flow in _scheduler_flows(chunk_tokens):
                scheduler, num_tokens = _warm_scheduler(flow, blocks, per_step)
                totals.clear()
                calls.clear()
                runs = max(1, requests // per_step)
                # Without collections, as scheduler_cost's fit: a collection
                # would fall in whichever call allocates when it runs over.
                gc.disable()
                try:
                    seconds = _run_requests(
                        scheduler, flow, num_tokens, per_step, runs, "r"
                    )
                finally:
                    gc.enable()
                gc.unfreeze()
                num_requests = runs * per_step
                print(
                    f"{flow.name}, {blocks} blocks, {per_step} per step: "
                    f"{seconds / num_requests * 1e6:.1f} us per request "
                    "(scheduler_seconds, without collections)"
                )
                for name, total in sorted(totals.items(), key=lambda item: -item[1]):
                    print(
                        f"  {name:<40}{total / num_requests * 1e6:8.1f} us/request"
                        f"{total / calls[name] * 1e6:8.1f} us/call"
                    )
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Decode TTFT spreads wide (p90 about 6x the median, plain NIXL too):
    # 20 prompts x 5 rounds gave on+scheduler x1.23 [0.81, 1.63], 40 x 5
    # x0.99 [0.96, 1.10] on the same machine.
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=1,
        help="rounds of the same prompts before the measured ones, not measured",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--pollers",
        choices=("nice", "focus"),
        default="nice",
        help="NIXL's busy pollers: all at nice 19 (nice), or, per request, "
        "the measured pair's at nice 0 and every other instance's idle (focus)",
    )
    parser.add_argument(
        "--scheduler-cost",
        action="store_true",
        help="only the scheduler-side cost, in process (no servers)",
    )
    parser.add_argument(
        "--per-step",
        default="1,16",
        help="--scheduler-cost and --scheduler-breakdown: requests going "
        "through the same engine steps, comma-separated levels",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="--scheduler-cost and --scheduler-breakdown: producers' prompts "
        "also prefilled in chunks of this many tokens (vLLM's chunked "
        "prefill, as every long prompt is); 0 for none",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="OUT",
        help="only print the table of several runs' --out files, their rounds "
        "pooled (no servers)",
    )
    parser.add_argument(
        "--scheduler-breakdown",
        action="store_true",
        help="only where the scheduler-side time goes, call by call (no servers)",
    )
    args = parser.parse_args()
    per_steps = [int(n) for n in args.per_step.split(",")]
    if args.combine:
        summary, phases = combine(args.combine)
        print_table(summary, phases)
        print(
            f"{len(args.combine)} runs, {len(summary[phases[0]]['samples_ms'])} rounds"
        )
        return
    if args.scheduler_breakdown:
        scheduler_breakdown(64, per_steps, 320, args.chunk_tokens or None)
        return
    if args.scheduler_cost:
        scheduler_cost([4, 64, 512, 2048], per_steps, 100, 5, args.chunk_tokens or None)
        return
    ensure_model()
    summary = await run(args)
    print(json.dumps(summary, indent=2))
    print_table(summary, args.phases.split(","))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
