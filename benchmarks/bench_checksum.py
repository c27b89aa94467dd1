"""KV checksum benchmark: worker throughput against ``torch.sum`` over the same
bytes, the scheduler's time to verify a long request, and payload size.

    python benchmarks/bench_checksum.py                  # CPU, eager and compiled
    python benchmarks/bench_checksum.py --device cuda    # a GPU, in one shot

Goals (issue 2): worker >= 0.5x torch.sum's GB/s on a CPU, >= 1.2 TB/s on an
H200; verifying a 128k-token request (block size 16, two groups, 8 TP
reports) <= 1 ms. Figures are of this run only: the ratio is the number to
compare across machines.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_patch.config import KVChecksumConfig
from engine_patch.host import CacheHitSource
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_times(
    fns: list[Callable[[], object]], device: torch.device, reps: int
) -> list[float]:
    """Seconds of the fastest of ``reps`` runs of each function, after a
    warm-up run; runs interleaved, so that load from other processes skews
    them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    sync(device)
    for _ in range(reps):
        for fn, fn_times in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync(device)
            fn_times.append(time.perf_counter() - start)
    return [min(fn_times) for fn_times in times]


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

    @property
    def ratio(self) -> float:
        return self.worker_gbs / self.sum_gbs


def bench_worker(
    layers: list[KVLayer], device: torch.device, compile: bool, reps: int
) -> WorkerFigures:
    """One request over every block, as a consumer's load: its checksum
    against ``torch.sum`` of each layer's bytes."""
    worker = KVChecksumWorker(layers, compile=compile)
    num_blocks = layers[0].kv.shape[1 if layers[0].layout is KVLayout.SPLIT else 0]
    block_ids = np.random.default_rng(0).permutation(num_blocks).tolist()
    blocks = KVChecksumBlocks(num_blocks * BLOCK_SIZE, {0: (0, block_ids)})
    total_bytes = sum(layer.kv.numel() * layer.kv.element_size() for layer in layers)
    step_times: list[float] = []

    def checksum() -> KVChecksumRecord | None:
        worker.begin_step(KVChecksumScheduled(reqs_to_recv={"r": blocks}))
        start = time.perf_counter()
        worker.on_loads_finished(["r"])
        # What the step spends: on CUDA, only launching (no host sync).
        step_times.append(time.perf_counter() - start)
        return worker.take_record()

    pieces = [layer.kv.view(torch.int64) for layer in layers]
    sum_s, worker_s = best_times(
        [lambda: [p.sum() for p in pieces], checksum], device, reps
    )
    return WorkerFigures(
        "compiled" if compile else "eager",
        total_bytes / 1e9,
        total_bytes / sum_s / 1e9,
        total_bytes / worker_s / 1e9,
        1e3 * min(step_times),
    )


def check_device(device: torch.device) -> None:
    """On an accelerator: the worker's values equal the CPU's, eager and
    compiled, over every layout, and (CUDA) a step's checksum calls never
    wait for the device.

    Raises:
        AssertionError: If not.
    """
    rng = np.random.default_rng(1)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
    for layout in KVLayout:
        for dtype in dtypes:
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
                KVLayer(
                    layer.name,
                    layer.index,
                    0,
                    layer.kv.to(device),
                    layout,
                    head_offset=3,
                )
                for layer in cpu_layers
            ]
            num_blocks = len(make_blocks_ids(cpu_layers[0]))
            ids = rng.permutation(num_blocks)[: num_blocks // 2].tolist()
            blocks = KVChecksumBlocks((2 + len(ids)) * BLOCK_SIZE - 5, {0: (2, ids)})
            expected = load(KVChecksumWorker(cpu_layers, compile=False), blocks)
            for compile in (False, True):
                worker = KVChecksumWorker(dev_layers, compile=compile)
                load(worker, blocks)  # Warm-up (compiles).
                got = load(worker, blocks, forbid_sync=device.type == "cuda")
                assert (got == expected).all(), (layout, dtype, compile)
    print(
        f"device check: {device} values == CPU values, eager and compiled, "
        f"{len(KVLayout)} layouts x {len(dtypes)} dtypes; no host sync in a step"
    )


def make_blocks_ids(layer: KVLayer) -> range:
    return range(layer.kv.shape[1 if layer.layout is KVLayout.SPLIT else 0])


def load(
    worker: KVChecksumWorker, blocks: KVChecksumBlocks, *, forbid_sync: bool = False
) -> np.ndarray:
    """A consumer load's values; ``forbid_sync`` makes CUDA raise if the
    step's part (``on_loads_finished``) waits for the device."""
    worker.begin_step(KVChecksumScheduled(reqs_to_recv={"r": blocks}))
    if forbid_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        worker.on_loads_finished(["r"])
    finally:
        if forbid_sync:
            torch.cuda.set_sync_debug_mode("default")
    record = worker.take_record()
    assert record is not None
    return record.checksums["r"][0].values


@dataclass(frozen=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--kv-gib", type=float, help="KV checked per run (CPU 1, CUDA 16)"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modes", default="eager,compiled")
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
    kv_gib = args.kv_gib or (16.0 if device.type == "cuda" else 1.0)
    if args.layout:
        layout = KVLayout(args.layout)
    else:
        layout = KVLayout.SPLIT if device.type == "cuda" else KVLayout.PACKED_HND
    layers = make_layers(device, int(kv_gib * (1 << 30)), args.layers, layout)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    if device.type != "cpu" or args.check:
        check_device(device)
    print(
        f"KV checksum worker on {where}: {args.layers} layers, bf16, block 16, "
        f"{HEADS}x{HEAD_SIZE} heads, {layers[0].layout.name}"
    )
    print(
        f"{'mode':<9} {'KV GB':>6} {'sum GB/s':>9} {'worker GB/s':>12} "
        f"{'ratio':>6} {'step ms':>8}"
    )
    for mode in args.modes.split(","):
        start = time.perf_counter()
        figures = bench_worker(layers, device, mode == "compiled", args.reps)
        print(
            f"{figures.mode:<9} {figures.gbytes:>6.2f} {figures.sum_gbs:>9.1f} "
            f"{figures.worker_gbs:>12.2f} {figures.ratio:>6.2f} "
            f"{figures.step_ms:>8.1f}   ({time.perf_counter() - start:.0f} s "
            "with warm-up/compile)"
        )
    print(
        "goal: ratio >= 0.5 on a CPU; >= 1200 GB/s on an H200. 'step ms' is "
        "what on_loads_finished takes (CUDA: launches only)."
    )
    verify_ms, payload_bytes = bench_scheduler()
    print(
        f"\nscheduler: verify a 128k-token load (block 16, 2 groups, 8 TP "
        f"reports): {verify_ms:.3f} ms (goal <= 1 ms)"
    )
    print(f"payload: {payload_bytes:.2f} bytes per block (msgpack; x4/3 in base64)")


if __name__ == "__main__":
    main()
