"""KV checksum benchmark: the worker's cost on small requests (per-op
dispatch) and its throughput on large KV against ``torch.sum`` over the same
bytes, eager and compiled, the per-request path of ``--baseline`` against
the fused pass; the scheduler's time to verify a long request; payload size.

    python benchmarks/bench_checksum.py                  # CPU, everything
    python benchmarks/bench_checksum.py --device cuda    # a GPU, in one shot

Goals (issues 2 and 8): worker >= 0.5x torch.sum's GB/s on a CPU, >= 1.2 TB/s
on an H200; verifying a 128k-token request (block size 16, two groups, 8 TP
reports) <= 1 ms. Figures are of this run only: ratios between paths and
modes measured in the same run are the numbers to compare across machines.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from git_baseline import source_at

from engine_patch import checksum_kernel, worker
from engine_patch.config import KVChecksumConfig
from engine_patch.host import CacheHitSource, FinishReason
from engine_patch.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY, KVChecksumPayload
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.types import (
    KVChecksumBlocks,
    KVChecksumGroup,
    KVChecksumRecord,
    KVChecksumScheduled,
)
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

# A Llama-3-8B-like layer: 8 KV heads of 128, bf16, 16-token blocks.
HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 8, 128, 16, torch.bfloat16
BLOCK_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 2

# The per-request worker (one chain of torch ops per request, layer and
# chunk) before the fused pass: the commit that last had it.
BASELINE_REV = "798f4d8"

# The tiny llama of the real-vLLM tests: 2 layers, 2 KV heads of 32, bf16,
# block 32, ~370-token prompts: 12 blocks, 192 KiB of KV per request.
SMALL_LAYERS, SMALL_HEADS, SMALL_HEAD_SIZE, SMALL_BLOCK = 2, 2, 32, 32
SMALL_PROMPT = 370


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    fns: list[Callable[[], object]],
    device: torch.device,
    reps: int,
    before: Callable[[], object] | None = None,
) -> list[list[float]]:
    """Seconds of ``reps`` runs of each function, after a warm-up run; runs
    interleaved, so that load from other processes skews them alike.
    ``before`` runs, untimed, before each timed run."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    sync(device)
    for _ in range(reps):
        for fn, fn_times in zip(fns, times, strict=True):
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            sync(device)
            fn_times.append(time.perf_counter() - start)
    return times


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs), 32 MiB where it cannot tell."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20}
        if size[-1:] in units and size[:-1].isdigit():
            sizes.append(int(size[:-1]) * units[size[-1]])
    return max(sizes, default=32 << 20)


def cache_evictor() -> Callable[[], object]:
    """A call that reads twice the last-level cache's bytes, so that the next
    step finds none of its code or data cached: as in an engine, whose
    scheduling, HTTP and model work run between two checksum passes. A pass
    of small requests is mostly per-op dispatch, and on this project's CPU
    it takes about twice as long cold as in a loop of passes."""
    buffer = np.ones(2 * last_level_cache_bytes() // 8, np.int64)
    return buffer.sum


def best_times(
    fns: list[Callable[[], object]], device: torch.device, reps: int
) -> list[float]:
    """The fastest of :func:`interleaved_times`' runs of each function."""
    return [min(t) for t in interleaved_times(fns, device, reps)]


def load_baseline(rev: str) -> types.ModuleType | None:
    """``engine_patch.worker`` as of git revision ``rev`` (with its own
    ``checksum_kernel``), or None outside a git checkout that has it."""
    sources = {}
    for name in ("checksum_kernel", "worker"):
        text = source_at(rev, f"engine_patch/{name}.py")
        if text is None:
            return None
        sources[name] = text
    modules = {}
    for name, text in sources.items():
        module = types.ModuleType(f"kvguard_baseline_{name}")
        sys.modules[module.__name__] = module
        text = text.replace(
            "from engine_patch import checksum_kernel",
            "import kvguard_baseline_checksum_kernel as checksum_kernel",
        )
        exec(compile(text, f"{rev}:engine_patch/{name}.py", "exec"), module.__dict__)
        modules[name] = module
    return modules["worker"]


@dataclass(frozen=True)
class Variant:
    """A worker implementation and mode under test."""

    name: str
    module: types.ModuleType
    compile: bool
    # False: an eager pass in torch's ops on a CPU too (mode "torch").
    host_pass: bool = True

    def worker(self, layers: list[KVLayer]) -> Any:
        """A worker of this variant over ``layers``' tensors."""
        m = self.module
        # Older workers (a baseline) have no host pass to turn off.
        extra = {} if self.host_pass else {"host_pass": False}
        return m.KVChecksumWorker(
            [
                m.KVLayer(
                    layer.name,
                    layer.index,
                    layer.group_id,
                    layer.kv,
                    m.KVLayout(layer.layout.value),
                )
                for layer in layers
            ],
            compile=self.compile,
            **extra,
        )


def variants(baseline: types.ModuleType | None, modes: list[str]) -> list[Variant]:
    """Per mode (eager, torch: eager in torch's ops on a CPU, compiled) this
    tree's worker, and the baseline's but in torch mode."""
    found = []
    for mode in modes:
        compiled, host_pass = mode == "compiled", mode != "torch"
        if baseline is not None and host_pass:
            found.append(Variant(f"old {mode}", baseline, compiled))
        found.append(Variant(f"fused {mode}", worker, compiled, host_pass))
    return found


def small_layers(device: torch.device, num_blocks: int) -> list[KVLayer]:
    """The tiny llama's KV as vLLM 0.32 allocates it on a CPU: one buffer,
    ``[layers, blocks, heads, block_size, K+V]`` (packed HND) per layer."""
    buf = torch.randint(
        -(2**15),
        2**15,
        (SMALL_LAYERS, num_blocks, SMALL_HEADS, SMALL_BLOCK, 2 * SMALL_HEAD_SIZE),
        dtype=torch.int16,
        device=device,
    ).view(torch.bfloat16)
    return [
        KVLayer(f"model.layers.{i}.self_attn.attn", i, 0, buf[i], KVLayout.PACKED_HND)
        for i in range(SMALL_LAYERS)
    ]


def small_requests(ids: list[int], batch: int) -> dict[str, KVChecksumBlocks]:
    """``batch`` of the tiny model's requests, each on the next of ``ids``'
    blocks."""
    per_request = -(-SMALL_PROMPT // SMALL_BLOCK)
    return {
        f"r{i}": KVChecksumBlocks(
            SMALL_PROMPT, {0: (0, ids[i * per_request : (i + 1) * per_request])}
        )
        for i in range(batch)
    }


def step_fn(
    checksums: Any, requests: dict[str, KVChecksumBlocks], send: bool
) -> Callable[[], Any]:
    """One engine step's checksum work: a producer's sends after the forward,
    or a consumer's finished loads; the record taken (waits for the
    device)."""

    def step() -> Any:
        if send:
            checksums.begin_step(KVChecksumScheduled(reqs_to_send=requests))
            checksums.after_forward()
        else:
            checksums.begin_step(KVChecksumScheduled(reqs_to_recv=requests))
            checksums.on_loads_finished(list(requests))
        return checksums.take_record()

    return step


def bench_small(
    device: torch.device,
    found: list[Variant],
    batches: list[int],
    reps: int,
    caches: list[str],
) -> None:
    """Per step, ms of checksumming ``batch`` tiny-llama requests, every
    variant interleaved; values checked equal across variants first. Per
    ``caches`` entry: ``warm`` (steps back to back) or ``cold`` (caches
    evicted before each step, :func:`cache_evictor`: what a step costs in
    an engine)."""
    blocks_per_request = -(-SMALL_PROMPT // SMALL_BLOCK)
    num_blocks = blocks_per_request * max(batches) + 1
    layers = small_layers(device, num_blocks)
    kv_bytes = (
        SMALL_LAYERS * SMALL_HEADS * SMALL_BLOCK * 2 * SMALL_HEAD_SIZE * 2
    ) * blocks_per_request
    print(
        f"\nsmall requests: tiny llama ({SMALL_LAYERS} layers, {SMALL_HEADS} KV "
        f"heads x {SMALL_HEAD_SIZE}, bf16, block {SMALL_BLOCK}, packed HND), "
        f"{SMALL_PROMPT}-token prompts = {kv_bytes / 1024:.0f} KiB of KV each; "
        f"median ms per step of {reps}"
    )
    workers = [variant.worker(layers) for variant in found]
    first_calls = []
    for variant, checksums in zip(found, workers, strict=True):
        blocks = {"w": KVChecksumBlocks(SMALL_PROMPT, {0: (0, [1, 2])})}
        start = time.perf_counter()
        step_fn(checksums, blocks, send=False)()
        first_calls.append(f"{variant.name} {time.perf_counter() - start:.1f} s")
    print("first call (compiles where compiled): " + ", ".join(first_calls))
    for cache in caches:
        evict = cache_evictor() if cache == "cold" and device.type == "cpu" else None
        if cache == "cold" and evict is None:
            continue
        print(
            "caches cold: evicted before each step (as in an engine)"
            if evict is not None
            else "caches warm: steps back to back"
        )
        _bench_small_steps(device, found, workers, batches, reps, num_blocks, evict)


def _bench_small_steps(
    device: torch.device,
    found: list[Variant],
    workers: list[Any],
    batches: list[int],
    reps: int,
    num_blocks: int,
    evict: Callable[[], object] | None,
) -> None:
    names = [variant.name for variant in found]
    print(f"{'path':<5} {'batch':>5} " + " ".join(f"{n:>14}" for n in names))
    ratio_rows = []
    rng = np.random.default_rng(0)
    for send in (False, True):
        for batch in batches:
            requests = small_requests(
                rng.permutation(np.arange(1, num_blocks)).tolist(), batch
            )
            fns = [step_fn(w, requests, send) for w in workers]
            expected = [fn() for fn in fns]
            for record in expected[1:]:
                for req_id in requests:
                    assert (
                        record.checksums[req_id][0].values
                        == expected[0].checksums[req_id][0].values
                    ).all(), "variants disagree"
            medians = [
                1e3 * statistics.median(t)
                for t in interleaved_times(fns, device, reps, evict)
            ]
            path = "send" if send else "load"
            print(f"{path:<5} {batch:>5} " + " ".join(f"{m:>14.3f}" for m in medians))
            ratio_rows.append((path, batch, dict(zip(names, medians, strict=True))))
    print_ratios(ratio_rows)


def print_ratios(rows: list[tuple[str, int, dict[str, float]]]) -> None:
    """fused/old per mode and compiled/eager per path, where measured."""
    pairs = [
        ("fused/old eager", "fused eager", "old eager"),
        ("fused/old compiled", "fused compiled", "old compiled"),
        ("compiled/eager fused", "fused compiled", "fused eager"),
        ("fused compiled/old eager", "fused compiled", "old eager"),
        ("eager/torch fused", "fused eager", "fused torch"),
    ]
    pairs = [p for p in pairs if p[1] in rows[0][2] and p[2] in rows[0][2]]
    print(f"{'path':<5} {'batch':>5} " + " ".join(f"{p[0]:>24}" for p in pairs))
    for path, batch, medians in rows:
        print(
            f"{path:<5} {batch:>5} "
            + " ".join(f"{medians[a] / medians[b]:>24.2f}" for _, a, b in pairs)
        )


def make_layers(
    device: torch.device, kv_bytes: int, num_layers: int, layout: KVLayout
) -> list[KVLayer]:
    """Layers of random KV totalling about ``kv_bytes``."""
    num_blocks = max(1, kv_bytes // (num_layers * BLOCK_BYTES))
    shapes = {
        KVLayout.SPLIT: (2, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE),
        KVLayout.PACKED_HND: (num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE),
        KVLayout.PACKED_NHD: (num_blocks, BLOCK_SIZE, HEADS, 2 * HEAD_SIZE),
    }
    return [
        KVLayer(
            f"model.layers.{index}.attn",
            index,
            0,
            torch.randint(
                -(2**15), 2**15, shapes[layout], dtype=torch.int16, device=device
            ).view(DTYPE),
            layout,
        )
        for index in range(num_layers)
    ]


@dataclass
class WorkerFigures:
    mode: str
    gbytes: float
    sum_gbs: float
    worker_gbs: float
    step_ms: float
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    # The load's values (group 0), from its last run.
    values: np.ndarray | None = None

    @property
    def ratio(self) -> float:
        return self.worker_gbs / self.sum_gbs


def bench_worker(
    layers: list[KVLayer], device: torch.device, variant: Variant, reps: int
) -> WorkerFigures:
    """One request over every block, as a consumer's load: its checksum
    against ``torch.sum`` of each layer's bytes."""
    checksums = variant.worker(layers)
    num_blocks = layers[0].kv.shape[1 if layers[0].layout is KVLayout.SPLIT else 0]
    block_ids = np.random.default_rng(0).permutation(num_blocks).tolist()
    blocks = KVChecksumBlocks(num_blocks * BLOCK_SIZE, {0: (0, block_ids)})
    total_bytes = sum(layer.kv.numel() * layer.kv.element_size() for layer in layers)
    step_times: list[float] = []
    records: list[KVChecksumRecord | None] = []

    def checksum() -> None:
        checksums.begin_step(KVChecksumScheduled(reqs_to_recv={"r": blocks}))
        start = time.perf_counter()
        checksums.on_loads_finished(["r"])
        # What the step spends: on CUDA, only launching (no host sync).
        step_times.append(time.perf_counter() - start)
        records[:] = [checksums.take_record()]

    pieces = [layer.kv.view(torch.int64) for layer in layers]
    sum_s, worker_s = best_times(
        [lambda: [p.sum() for p in pieces], checksum], device, reps
    )
    return WorkerFigures(
        variant.name,
        total_bytes / 1e9,
        total_bytes / sum_s / 1e9,
        total_bytes / worker_s / 1e9,
        1e3 * min(step_times),
        values=None if records[0] is None else records[0].checksums["r"][0].values,
    )


def check_layers(
    layout: KVLayout, dtype: torch.dtype, device: torch.device
) -> tuple[list[KVLayer], list[KVLayer]]:
    """Two layers of random KV in ``layout`` and ``dtype`` (their heads from
    the 4th of the model's) on the CPU, and the same on ``device``: a
    device's values checked against the CPU's."""
    cpu_layers = [
        KVLayer(
            layer.name,
            layer.index,
            0,
            layer.kv.view(torch.uint8).view(dtype),
            layout,
            head_offset=3,
        )
        for layer in make_layers(torch.device("cpu"), 2 << 20, 2, layout)
    ]
    dev_layers = [
        KVLayer(layer.name, layer.index, 0, layer.kv.to(device), layout, head_offset=3)
        for layer in cpu_layers
    ]
    return cpu_layers, dev_layers


# The dtypes a device's values are checked in.
CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)


def device_failures(
    device: torch.device,
    compiles: list[bool],
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
    host_pass: bool = True,
) -> list[str]:
    """Whether the worker's values on ``device`` equal the CPU's (in each of
    ``compiles``) over every layout and ``dtypes``, in passes of several
    requests and of one block, and in :func:`check_mixed_pass`; (CUDA)
    whether a step's checksum calls never wait for the device; and whether
    a fused kernel ran rather than fell back to eager. Returns what failed.
    ``host_pass`` False keeps a CPU's passes in torch's ops, the path
    devices take."""
    rng = np.random.default_rng(1)
    failures: list[str] = []
    for layout in KVLayout:
        for dtype in dtypes:
            cpu_layers, dev_layers = check_layers(layout, dtype, device)
            num_blocks = len(make_blocks_ids(cpu_layers[0]))
            ids = rng.permutation(num_blocks)[: num_blocks // 2].tolist()
            blocks = {
                "a": KVChecksumBlocks((2 + len(ids)) * BLOCK_SIZE - 5, {0: (2, ids)}),
                # One block: torch.compile specializes a dim of size 1.
                "b": KVChecksumBlocks(BLOCK_SIZE, {0: (0, [ids[0]])}),
            }
            expected = load_all(KVChecksumWorker(cpu_layers, compile=False), blocks)
            for compile in compiles:
                case = f"{layout.name} {dtype} compile={compile}"
                worker = KVChecksumWorker(
                    dev_layers, compile=compile, host_pass=host_pass
                )
                failures += _check_values(
                    case, partial(load_all, worker, blocks), _same_values(expected)
                )
                failures += _check_no_sync(
                    case, device, partial(load_all, worker, blocks, forbid_sync=True)
                )
    failures += check_mixed_pass(device, compiles, host_pass)
    if any(compiles) and not checksum_kernel.can_compile():
        failures.append("a fused kernel failed: those passes ran eagerly")
    return failures


def check_device(device: torch.device, compiles: list[bool]) -> list[str]:
    """On an accelerator: :func:`device_failures`, printed. Returns what
    failed (nothing when all held), so that one failure does not cost the
    other figures of a lent machine's run."""
    failures = device_failures(device, compiles)
    kernels = " and ".join("compiled" if c else "eager" for c in compiles)
    print(
        f"device check: {device} values == CPU values ({kernels}), "
        f"{len(KVLayout)} layouts x {len(CHECK_DTYPES)} dtypes, and a pass mixing "
        "requests, stacked layers, 16-token spans and Mamba states; no host "
        "sync in a step: " + ("all held" if not failures else f"{len(failures)} FAILED")
    )
    for failure in failures:
        print(f"  FAILED: {failure}")
    return failures


def _same_values(
    expected: dict[str, dict[int, np.ndarray]],
) -> Callable[[dict[str, dict[int, np.ndarray]]], bool]:
    """Whether a pass's values (:func:`load_all`) are ``expected``."""

    def equal(got: dict[str, dict[int, np.ndarray]]) -> bool:
        return all(
            (got[req_id][group_id] == values).all()
            for req_id, groups in expected.items()
            for group_id, values in groups.items()
        )

    return equal


def _check_values(
    case: str, run: Callable[[], Any], equal: Callable[[Any], Any]
) -> list[str]:
    """``run`` twice (the first compiles where compiled): its values equal
    the CPU's both times, or what failed."""
    try:
        for _ in range(2):
            if not np.all(equal(run())):
                return [f"{case}: values differ from the CPU's"]
    except Exception as e:  # Whatever the device raises, reported.
        return [f"{case}: {type(e).__name__}: {e}"]
    return []


def _check_no_sync(
    case: str, device: torch.device, run: Callable[[], Any]
) -> list[str]:
    """On CUDA: ``run`` (which forbids host syncs in a step's part) raises
    nothing, or what it raised."""
    if device.type != "cuda":
        return []
    try:
        run()
    except Exception as e:  # The sync debug mode raises RuntimeError.
        return [f"{case}: a step waits for the device: {type(e).__name__}: {e}"]
    return []


def mixed_layers(
    attention: torch.Tensor, sliding: torch.Tensor, pages: torch.Tensor
) -> list[KVLayer | worker.KVStateLayer]:
    """Views of three buffers as three groups: packed-HND layers of one
    buffer (vLLM's), block-major SPLIT sliding-window layers, and Mamba2
    state layers cut from one page per block (TP rank 1 of 2)."""
    conv, ssm = (128, 3), (8, 8, 16)
    shards = [
        worker.StateShard.split(conv, 0, 2, 1, (64, 32, 32)),
        worker.StateShard.split(ssm, 0, 2, 1),
    ]
    return [
        *(
            KVLayer(f"model.layers.{i}.attn", i, 0, attention[i], KVLayout.PACKED_HND)
            for i in range(len(attention))
        ),
        *(
            KVLayer(
                f"model.layers.{4 + i}.attn",
                4 + i,
                1,
                sliding[:, i].transpose(0, 1),
                KVLayout.SPLIT,
                spec_type="sliding_window",
            )
            for i in range(sliding.shape[1])
        ),
        *(
            worker.KVStateLayer(
                f"model.layers.{8 + i}.mixer",
                8 + i,
                2,
                tuple(
                    worker.StateTensor(view, shard)
                    for view, shard in zip(
                        worker.state_views(
                            pages[i],
                            [shard.local_shape() for shard in shards],
                            [torch.bfloat16, torch.float32],
                        ),
                        shards,
                        strict=True,
                    )
                ),
            )
            for i in range(len(pages))
        ),
    ]


def check_mixed_pass(
    device: torch.device, compiles: list[bool], host_pass: bool = True
) -> list[str]:
    """Whether one pass over requests of all three groups of
    :func:`mixed_layers` gives the CPU's values on ``device`` (in each of
    ``compiles``; ``host_pass`` as :func:`device_failures`) without a host
    sync (CUDA); what failed."""
    gen = torch.Generator().manual_seed(2)

    def random_bytes(*shape: int) -> torch.Tensor:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)

    buffers = [
        random_bytes(2, 64, 2, 16, 128).view(torch.bfloat16),
        random_bytes(64, 2, 2, 32, 2, 64).view(torch.float16),
        random_bytes(2, 64, 64 * 3 * 2 + 4 * 8 * 16 * 4 + 64),
    ]
    cpu = KVChecksumWorker(mixed_layers(*buffers), tp_rank=1, compile=False)
    on_device = [b.to(device) for b in buffers]
    blocks = {
        f"r{i}": KVChecksumBlocks(
            40 + 37 * i,
            {
                0: (i % 2, [3 * i + 1, 3 * i + 2, 3 * i + 3]),
                1: (0, [i, 9 + i]),
                2: (0, [i]),
            },
        )
        for i in range(6)
    }
    equal = _same_values(load_all(cpu, blocks))
    failures: list[str] = []
    for compile in compiles:
        case = f"mixed pass compile={compile}"
        checksums = KVChecksumWorker(
            mixed_layers(*on_device), tp_rank=1, compile=compile, host_pass=host_pass
        )
        failures += _check_values(case, partial(load_all, checksums, blocks), equal)
        failures += _check_no_sync(
            case, device, partial(load_all, checksums, blocks, forbid_sync=True)
        )
    return failures


def load_all(
    checksums: KVChecksumWorker,
    blocks: dict[str, KVChecksumBlocks],
    *,
    forbid_sync: bool = False,
) -> dict[str, dict[int, np.ndarray]]:
    """Per request and group, the values of one pass loading them all."""
    checksums.begin_step(KVChecksumScheduled(reqs_to_recv=blocks))
    if forbid_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        checksums.on_loads_finished(list(blocks))
    finally:
        if forbid_sync:
            torch.cuda.set_sync_debug_mode("default")
    record = checksums.take_record()
    assert record is not None
    return {
        req_id: {g: group.values for g, group in groups.items()}
        for req_id, groups in record.checksums.items()
    }


def make_blocks_ids(layer: KVLayer) -> range:
    return range(layer.kv.shape[1 if layer.layout is KVLayout.SPLIT else 0])


# As vLLM's KVCacheBlock: a slots dataclass, whose attributes read as fast.
@dataclass(slots=True)
class _Block:
    block_id: int
    is_null: bool = False


@dataclass
class _Blocks:
    blocks: list[list[_Block]]


@dataclass
class _Request:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int
    num_prompt_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)

    def get_finished_reason(self) -> int | None:
        return None


class _Connector:
    def get_external_cache_hit_sources(
        self, request: object, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return {CacheHitSource.P2P: num_external_tokens}

    def get_kv_checksum_sources(self, request: object) -> frozenset[CacheHitSource]:
        return frozenset()

    def on_kv_checksum_failure(
        self, request: object, mismatches: dict[int, list[int]]
    ) -> None:
        pass


@dataclass
class _Output:
    kv_checksums: list[KVChecksumRecord]
    finished_recving: set[str]


def bench_scheduler(
    num_tokens: int = 128 * 1024, tp: int = 8, num_groups: int = 2, reps: int = 20
) -> tuple[float, float]:
    """Median ms of ``update_from_output`` verifying one consumer load of
    ``num_tokens`` tokens (``tp`` reports, ``num_groups`` groups), and the
    producer payload's bytes per block."""
    rng = np.random.default_rng(0)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    groups = [KVCacheGroup(FullAttentionSpec(BLOCK_SIZE)) for _ in range(num_groups)]
    scheduler = KVChecksumScheduler(
        KVChecksumConfig(tp_size=tp, fail_closed=True),
        KVCacheConfig(groups),
        _Connector(),
    )
    fingerprint = 0x5EED
    shares = {
        g: rng.integers(0, 2**63, size=(tp, num_blocks), dtype=np.uint64)
        for g in range(num_groups)
    }
    payload = KVChecksumPayload(
        tp,
        num_tokens,
        {
            g: (fingerprint, BLOCK_SIZE, 0, shares[g].sum(axis=0, dtype=np.uint64))
            for g in range(num_groups)
        },
    )
    encoded = payload.to_base64()
    records = [
        KVChecksumRecord(
            pp_rank=0,
            tp_rank=rank,
            checksums={
                "r": {
                    g: KVChecksumGroup(0, [(1, 0)], shares[g][rank][:, None].copy())
                    for g in range(num_groups)
                }
            },
            fingerprints={g: fingerprint for g in range(num_groups)},
        )
        for rank in range(tp)
    ]
    block_table = _Blocks(
        [[_Block(i + 1) for i in range(num_blocks)] for _ in range(num_groups)]
    )
    times = []
    for i in range(reps):
        req_id = f"r{i}"
        request = _Request(
            req_id,
            {"do_remote_prefill": True, KV_TRANSFER_PARAMS_KEY: encoded},
            num_tokens,
            num_tokens,
        )
        scheduler.on_new_request(request)
        scheduler.add_recv(request, block_table, 0)
        scheduler.build_checksum_meta()
        for record in records:
            record.checksums = {req_id: record.checksums.popitem()[1]}
        output = _Output(records, {req_id})
        start = time.perf_counter()
        failed = scheduler.update_from_output(output, set())
        times.append(time.perf_counter() - start)
        assert not failed and scheduler.stats.verified == i + 1, scheduler.stats
    payload_bytes = len(payload.to_bytes()) / (num_blocks * num_groups)
    return 1e3 * statistics.median(times), payload_bytes


@dataclass
class _Finished(_Request):
    finish_reason: int | None = None

    def get_finished_reason(self) -> int | None:
        return self.finish_reason


class _KVCacheManager:
    def __init__(self, blocks: _Blocks) -> None:
        self.blocks = blocks

    def get_blocks(self, request_id: str) -> _Blocks:
        return self.blocks


def bench_scheduler_lifecycle(
    num_blocks: int,
    *,
    decode_steps: int = 4,
    reps: int = 200,
    scheduler_cls: type[KVChecksumScheduler] = KVChecksumScheduler,
) -> dict[str, float]:
    """CPU microseconds (median of ``reps``) of the scheduler's calls over
    one P/D request of ``num_blocks`` blocks (block 16, one group, TP 1), as
    an engine makes them, per side: the producer's (on_new_request; add_send,
    build_checksum_meta, update_from_output of the prefill step;
    request_finished) and the consumer's (on_new_request; add_recv and
    build_checksum_meta of the step starting the load; update_from_output
    verifying it; ``decode_steps`` steps of add_send and the rest;
    request_finished); and of one idle step (build_checksum_meta and
    update_from_output with nothing pending).

    The producer runs twice per request: with its block ids as vLLM's
    scheduler output lists a new request's (``producer``: a prompt prefilled
    in one step), and with its blocks read from the KV cache manager
    (``producer, chunked``: the last step of a chunked prefill). The first
    call after the idle step's collection (the producer's) pays for the
    caches the collection left cold, as the request's first call after a
    forward does in an engine; the per-block costs do not depend on it."""
    num_tokens = num_blocks * BLOCK_SIZE - 3
    config = KVCacheConfig([KVCacheGroup(FullAttentionSpec(BLOCK_SIZE))])
    producer, consumer = (
        scheduler_cls(KVChecksumConfig(tp_size=1), config, _Connector())
        for _ in range(2)
    )
    manager = _KVCacheManager(_Blocks([[_Block(i + 1) for i in range(num_blocks)]]))
    # A new request's block ids per group, as vLLM's scheduler output lists
    # them for its workers anyway (made outside the timed calls).
    new_ids = ([block.block_id for block in manager.blocks.blocks[0]],)
    values = np.random.default_rng(0).integers(
        0, 2**63, size=(num_blocks, 1), dtype=np.uint64
    )
    fingerprint = 0x5EED

    def record(req_id: str) -> KVChecksumRecord:
        group = KVChecksumGroup(0, [(1, 0)], values.copy())
        return KVChecksumRecord(
            0, 0, {req_id: {0: group}}, fingerprints={0: fingerprint}
        )

    def produce(req_id: str, chunked: bool) -> dict[str, Any]:
        params: dict[str, Any] = {"do_remote_decode": True}
        request = _Finished(req_id, params, num_tokens, num_tokens)
        producer.on_new_request(request)
        producer.add_send(request, num_tokens, manager, None if chunked else new_ids)
        producer.build_checksum_meta()
        producer.update_from_output(_Output([record(req_id)], set()), set())
        request.finish_reason = FinishReason.LENGTH
        sent: dict[str, Any] = {"do_remote_prefill": True}
        producer.request_finished(request, sent)
        return sent

    def consume(req_id: str, params: dict[str, Any]) -> None:
        request = _Finished(req_id, params, num_tokens, num_tokens)
        consumer.on_new_request(request)
        consumer.add_recv(request, manager.blocks, 0)
        consumer.build_checksum_meta()
        consumer.update_from_output(_Output([], set()), set())
        consumer.build_checksum_meta()
        failed = consumer.update_from_output(_Output([record(req_id)], {req_id}), set())
        assert not failed, consumer.take_load_failures()
        for step in range(decode_steps):
            request.num_computed_tokens = num_tokens + step
            consumer.add_send(request, 1, manager)
            consumer.build_checksum_meta()
            consumer.update_from_output(_Output([], set()), set())
        request.finish_reason = FinishReason.LENGTH
        consumer.request_finished(request, None)

    def idle() -> None:
        consumer.build_checksum_meta()
        consumer.update_from_output(_Output([], set()), set())

    # Records are made outside the timed calls.
    times: dict[str, list[float]] = {
        "producer": [],
        "producer, chunked": [],
        "consumer": [],
        "idle step": [],
    }
    for i in range(reps + 10):
        req_id = f"r{i}"
        start = time.thread_time()
        params = produce(req_id, chunked=False)
        chunked = time.thread_time()
        produce(f"{req_id}-chunked", chunked=True)
        mid = time.thread_time()
        consume(req_id, params)
        end = time.thread_time()
        # A collection the request's garbage makes due is not the idle
        # step's.
        gc.collect()
        before_idle = time.thread_time()
        idle()
        after = time.thread_time()
        if i >= 10:
            times["producer"].append(chunked - start)
            times["producer, chunked"].append(mid - chunked)
            times["consumer"].append(end - mid)
            times["idle step"].append(after - before_idle)
    assert consumer.stats.verified == reps + 10, consumer.stats
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def print_scheduler_lifecycle() -> None:
    print(
        "\nscheduler per P/D request (CPU us, block 16, one group, TP 1; records "
        "made outside; goal <= 50 us + 20 ns per block and side):"
    )
    names = ("producer", "producer, chunked", "consumer")
    print(
        f"{'blocks':>7} "
        + " ".join(f"{name:>17}" for name in names)
        + f" {'idle step':>10} {'goal':>7}"
    )
    rows = {}
    for num_blocks in (12, 8192):
        figures = bench_scheduler_lifecycle(
            num_blocks, reps=200 if num_blocks < 100 else 20
        )
        rows[num_blocks] = figures
        print(
            f"{num_blocks:>7} "
            + " ".join(f"{figures[name]:>17.1f}" for name in names)
            + f" {figures['idle step']:>10.2f} {50 + 0.02 * num_blocks:>7.1f}"
        )
    (small, few), (large, many) = rows.items()
    print(
        f"{'ns/block':>7} "
        + " ".join(
            f"{1e3 * (many[name] - few[name]) / (large - small):>17.1f}"
            for name in names
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--kv-gib", type=float, help="large KV checked per run (CPU 1, CUDA 16)"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5, help="large-KV runs")
    parser.add_argument("--small-reps", type=int, default=40)
    parser.add_argument("--batches", default="1,4,16", help="small-request batches")
    parser.add_argument(
        "--small-caches",
        default="warm,cold",
        help="small requests with caches warm (back to back) and/or cold "
        "(evicted before each step, as in an engine; CPU only)",
    )
    parser.add_argument(
        "--modes",
        default="eager,torch,compiled",
        help="eager (numpy on a CPU), torch (eager in torch's ops; CPU only), compiled",
    )
    parser.add_argument(
        "--parts",
        default="small,large,scheduler,lifecycle",
        help="what to run: small (requests), large (KV), scheduler, lifecycle "
        "(the scheduler's calls per P/D request)",
    )
    parser.add_argument(
        "--baseline",
        default=BASELINE_REV,
        help="git revision of the per-request worker to compare ('' for none)",
    )
    parser.add_argument(
        "--cold-compile",
        action="store_true",
        help="compile into a fresh inductor cache (measures a cold compile)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check values against the CPU first (always on accelerators)",
    )
    parser.add_argument(
        "--layout",
        choices=[layout.value for layout in KVLayout],
        help="KV layout (CPU: vLLM's CPU packed_hnd; CUDA: FlashAttention's split)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cold_compile:
        checksum_kernel.set_cache_dir(tempfile.mkdtemp(prefix="kvguard-inductor-"))
    parts = set(args.parts.split(","))
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.baseline and baseline is None:
        print(f"baseline {args.baseline} not found (not a git checkout?): skipped")
    modes = args.modes.split(",")
    if device.type != "cpu":
        # Off CPUs eager runs in torch's ops anyway.
        modes = [mode for mode in modes if mode != "torch"]
    found = variants(baseline, modes)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    failures = []
    if device.type != "cpu" or args.check:
        failures = check_device(device, [mode == "compiled" for mode in modes])
    print(
        f"KV checksum worker on {where}; 'old' = the per-request worker of "
        f"{args.baseline or '-'}, 'fused' = this tree's one pass per step"
    )
    if "small" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        caches = args.small_caches.split(",")
        bench_small(device, found, batches, args.small_reps, caches)
    if "large" in parts:
        kv_gib = args.kv_gib or (16.0 if device.type == "cuda" else 1.0)
        if args.layout:
            layout = KVLayout(args.layout)
        else:
            layout = KVLayout.SPLIT if device.type == "cuda" else KVLayout.PACKED_HND
        layers = make_layers(device, int(kv_gib * (1 << 30)), args.layers, layout)
        print(
            f"\nlarge KV: {args.layers} layers, bf16, block 16, "
            f"{HEADS}x{HEAD_SIZE} heads, {layers[0].layout.name}, one request"
        )
        print(
            f"{'mode':<15} {'KV GB':>6} {'sum GB/s':>9} {'worker GB/s':>12} "
            f"{'ratio':>6} {'step ms':>8}"
        )
        for variant in found:
            start = time.perf_counter()
            figures = bench_worker(layers, device, variant, args.reps)
            print(
                f"{figures.mode:<15} {figures.gbytes:>6.2f} {figures.sum_gbs:>9.1f} "
                f"{figures.worker_gbs:>12.2f} {figures.ratio:>6.2f} "
                f"{figures.step_ms:>8.1f}   ({time.perf_counter() - start:.0f} s "
                "with warm-up/compile)"
            )
            if variant.compile and not checksum_kernel.can_compile():
                print("  the compile FAILED (logged above): these are eager figures")
        print(
            "goal: ratio >= 0.5 on a CPU; >= 1200 GB/s on an H200. 'step ms' is "
            "what on_loads_finished takes (CUDA: launches only)."
        )
    if "scheduler" in parts:
        verify_ms, payload_bytes = bench_scheduler()
        print(
            f"\nscheduler: verify a 128k-token load (block 16, 2 groups, 8 TP "
            f"reports): {verify_ms:.3f} ms (goal <= 1 ms)"
        )
        print(f"payload: {payload_bytes:.2f} bytes per block (msgpack; x4/3 in base64)")
    if "lifecycle" in parts:
        print_scheduler_lifecycle()
    if failures:
        sys.exit(f"device check: {len(failures)} FAILED (above)")


if __name__ == "__main__":
    main()
