"""The fused checksum kernels (AOTInductor packages for host passes,
torch.compile on devices) give the eager kernel's bits, and compile only
when a worker warms up.

Building a package takes about 10 s per row shape, loading a built one
well under a second; set KVGUARD_SKIP_COMPILE_TESTS=1 to skip these tests.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from worker_helpers import (
    MIXED_REQUESTS,
    layers_in_one_buffer,
    make_kv,
    mamba2_states,
    rank_layers,
    recv_all,
    state_values,
    unsharded,
)

from engine_patch import aot_kernel, checksum_kernel
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

pytestmark = pytest.mark.skipif(
    os.environ.get("KVGUARD_SKIP_COMPILE_TESTS") == "1",
    reason="KVGUARD_SKIP_COMPILE_TESTS=1",
)


def test_compiled_kernel_equals_eager() -> None:
    layers = [
        # Rows gathered in memory order (HND), several layers per gather.
        *layers_in_one_buffer(KVLayout.PACKED_HND, torch.bfloat16),
        # K and V apart, one block-major buffer: another row shape.
        *layers_in_one_buffer(
            KVLayout.SPLIT, torch.float16, block_major=True, first_index=3, seed=1
        ),
        # Not viewable as pieces in place: gathered, then the same kernel.
        KVLayer(
            "b",
            7,
            0,
            make_kv(
                KVLayout.PACKED_HND, torch.uint8, "strided_last_dim", num_blocks=12
            ),
            KVLayout.PACKED_HND,
            head_offset=2,
        ),
        # 16-token spans of 32-token blocks.
        *layers_in_one_buffer(
            KVLayout.PACKED_NHD,
            torch.bfloat16,
            block_size=32,
            group_id=1,
            spec_type="sliding_window",
            first_index=8,
        ),
    ]
    compiled = KVChecksumWorker(layers, compile=True)
    compiled.warm_up()
    assert compiled.compiled
    eager = KVChecksumWorker(layers, compile=False)
    requests = [
        (req_id, num_tokens * 8, {0: (start, ids), 1: (start, ids)})
        for req_id, num_tokens, start, ids in MIXED_REQUESTS
    ]
    expected = recv_all(eager, requests)
    got = recv_all(compiled, requests)
    for req_id, _, _ in requests:
        for group_id in (0, 1):
            assert (got[req_id][group_id] == expected[req_id][group_id]).all()
    # The compiled kernel really ran (a failed compile falls back to eager).
    assert compiled.compiled


def tiny_llama_layers(num_blocks: int = 16) -> list[KVLayer]:
    """Two layers of 2 KV heads x 32 (bf16, packed HND, 16-token blocks) in
    one buffer, as vLLM allocates them on a CPU."""
    return layers_in_one_buffer(
        KVLayout.PACKED_HND,
        torch.bfloat16,
        num_layers=2,
        num_blocks=num_blocks,
        block_size=16,
        heads=2,
        last=64,
    )


def kernels_prepared() -> int:
    """Fused kernels compiled or loaded from disk in this process."""
    return checksum_kernel.compiles() + aot_kernel.loads()


@pytest.mark.parametrize("host_pass", [True, False], ids=["package", "dynamo"])
def test_after_warm_up_no_pass_compiles_again(host_pass: bool) -> None:
    # A compile inside an engine step stalls the engine for seconds (tens
    # with a cold cache), long enough for a producer's KV lease to lapse.
    # The warm-up passes two blocks then one, and this model has two KV
    # heads and two layers: dims that happen to be equal at the first
    # compile must not be taken for one (torch.compile's duck shapes).
    layers = tiny_llama_layers(num_blocks=24)
    compiled = KVChecksumWorker(layers, compile=True, host_pass=host_pass)
    compiled.warm_up()
    assert compiled.compiled
    prepared = kernels_prepared()
    eager = KVChecksumWorker(layers, compile=False)
    steps = [
        [("a", 8, {0: (0, [3])})],
        [("b", 100, {0: (0, [4, 9, 2, 17, 5, 6, 7])})],
        [
            ("c", 3 * 16, {0: (0, [1, 2, 3])}),
            ("d", 16 * 5 + 1, {0: (1, list(range(10, 15)))}),
        ],
        [("e", 16 * 20, {0: (0, list(range(1, 21)))})],
    ]
    for requests in steps:
        got = recv_all(compiled, requests)
        want = recv_all(eager, requests)
        for req_id, _, _ in requests:
            assert (got[req_id][0] == want[req_id][0]).all()
    assert kernels_prepared() == prepared
    assert compiled.compiled


def test_compiled_state_checksums_equal_eager() -> None:
    specs = mamba2_states("DS")
    layers = rank_layers(specs, unsharded(specs, 2, seed=1), 2, 1)
    compiled = KVChecksumWorker(layers, tp_rank=1, compile=True)
    eager = KVChecksumWorker(layers, tp_rank=1, compile=False)
    blocks = {"a": 1, "b": 4, "c": 0}
    got = state_values(compiled, blocks)
    assert compiled.compiled
    expected = state_values(eager, blocks)
    assert all((got[r] == expected[r]).all() for r in blocks)


def test_the_fused_kernel_is_the_default_on_accelerators_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(checksum_kernel.COMPILE_ENV, raising=False)
    assert checksum_kernel.compile_default(torch.device("cuda"))
    assert not checksum_kernel.compile_default(torch.device("cpu"))
    assert not checksum_kernel.compile_default()
    # A worker on a device (meta: no kernel runs) takes that default.
    kv = make_kv(KVLayout.SPLIT, torch.bfloat16, "contiguous").to("meta")
    assert KVChecksumWorker([KVLayer("a", 0, 0, kv, KVLayout.SPLIT)]).compiled
    cpu_kv = make_kv(KVLayout.SPLIT, torch.bfloat16, "contiguous")
    assert not KVChecksumWorker([KVLayer("a", 0, 0, cpu_kv, KVLayout.SPLIT)]).compiled


def test_compile_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for device in (None, torch.device("cpu"), torch.device("cuda")):
        monkeypatch.setenv(checksum_kernel.COMPILE_ENV, "1")
        assert checksum_kernel.compile_default(device)
        monkeypatch.setenv(checksum_kernel.COMPILE_ENV, "0")
        assert not checksum_kernel.compile_default(device)


def test_the_kernel_compiles_into_the_cache_dir_it_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/host/engine/cache")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv(checksum_kernel.CACHE_DIR_ENV, str(tmp_path))
    assert checksum_kernel.cache_dir() == str(tmp_path)
    with checksum_kernel.inductor_cache():
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
        assert os.environ["TRITON_CACHE_DIR"] == os.path.join(tmp_path, "triton")
    # The host's own compiles keep their cache.
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/host/engine/cache"
    assert "TRITON_CACHE_DIR" not in os.environ
    # Set in code (e.g. by the vLLM adapter), it wins over the environment.
    checksum_kernel.set_cache_dir("/vllm/cache/kvguard")
    try:
        assert checksum_kernel.cache_dir() == "/vllm/cache/kvguard"
    finally:
        checksum_kernel.set_cache_dir(None)


STEPS = [
    [("a", 8, {0: (0, [3])})],
    [("b", 100, {0: (0, [4, 9, 2, 11, 5, 6, 7])})],
]


def assert_equals_eager(worker: KVChecksumWorker, layers: list[KVLayer]) -> None:
    eager = KVChecksumWorker(layers, compile=False)
    for requests in STEPS:
        got = recv_all(worker, requests)
        want = recv_all(eager, requests)
        for req_id, _, _ in requests:
            assert (got[req_id][0] == want[req_id][0]).all()


@pytest.fixture
def fresh_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An empty package folder, and no kernel loaded in this process yet (as
    in a new one)."""
    monkeypatch.setattr(aot_kernel, "_kernels", {})
    checksum_kernel.set_cache_dir(str(tmp_path))
    yield tmp_path
    checksum_kernel.set_cache_dir(None)


def test_a_later_process_loads_the_package_instead_of_compiling(
    monkeypatch: pytest.MonkeyPatch,
    fresh_packages: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    layers = tiny_llama_layers()
    first = KVChecksumWorker(layers, compile=True)
    compiles, loads = checksum_kernel.compiles(), aot_kernel.loads()
    with caplog.at_level(logging.INFO, logger="kvguard.engine_patch.aot_kernel"):
        first.warm_up()
    # A build is logged before it starts: it can take minutes.
    assert "Building KVGuard's fused checksum kernel into" in caplog.text
    assert checksum_kernel.compiles() == compiles + 1
    assert aot_kernel.loads() == loads
    assert len(list(fresh_packages.glob("kvguard_aot/*.pt2"))) == 1
    # A new process: nothing in memory, the package on disk.
    monkeypatch.setattr(aot_kernel, "_kernels", {})
    later = KVChecksumWorker(layers, compile=True)
    later.warm_up()
    assert checksum_kernel.compiles() == compiles + 1
    assert aot_kernel.loads() == loads + 1
    assert later.compiled
    assert_equals_eager(later, layers)


def test_a_damaged_package_is_compiled_again(
    monkeypatch: pytest.MonkeyPatch, fresh_packages: Path
) -> None:
    layers = tiny_llama_layers()
    KVChecksumWorker(layers, compile=True).warm_up()
    (package,) = fresh_packages.glob("kvguard_aot/*.pt2")
    package.write_bytes(package.read_bytes()[:1000])
    monkeypatch.setattr(aot_kernel, "_kernels", {})
    compiles = checksum_kernel.compiles()
    worker = KVChecksumWorker(layers, compile=True)
    worker.warm_up()
    assert checksum_kernel.compiles() == compiles + 1
    assert worker.compiled
    assert_equals_eager(worker, layers)


def test_a_kernel_that_differs_from_the_eager_pass_is_never_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # E.g. a compiler bug, or a package that is not what its name says.
    monkeypatch.setattr(aot_kernel, "_kernels", {})
    monkeypatch.setattr(checksum_kernel, "_compile_failed", False)
    run = aot_kernel.HostKernel.__call__

    def off_by_one(self: aot_kernel.HostKernel, *args: Any) -> np.ndarray:
        return run(self, *args) + 1

    monkeypatch.setattr(aot_kernel.HostKernel, "__call__", off_by_one)
    layers = tiny_llama_layers()
    worker = KVChecksumWorker(layers, compile=True)
    worker.warm_up()
    assert not worker.compiled
    # The passes are eager, and right.
    assert_equals_eager(worker, layers)


WARM_UP_IN_A_NEW_PROCESS = """
import sys
from engine_patch import aot_kernel, checksum_kernel
from engine_patch.worker import KVChecksumWorker
sys.path.insert(0, {helpers!r})
from test_worker_compile import tiny_llama_layers
checksum_kernel.set_cache_dir({cache!r})
worker = KVChecksumWorker(tiny_llama_layers(), compile=True)
worker.warm_up()
assert worker.compiled
print(checksum_kernel.compiles(), aot_kernel.loads())
"""


def test_workers_starting_together_build_a_package_once(tmp_path: Path) -> None:
    # TP ranks, or engines sharing a machine, warm up at the same time.
    script = WARM_UP_IN_A_NEW_PROCESS.format(
        helpers=str(Path(__file__).parent), cache=str(tmp_path)
    )
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for process in starts:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        compiles, loads = map(int, out.split())
        results.append((compiles, loads))
    # One built it, the other waited and loaded it.
    assert sorted(results) == [(0, 1), (1, 0)]


def test_a_process_waiting_for_anothers_build_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    package = tmp_path / "kernel.pt2"
    entered = threading.Event()

    def wait_for_the_lock() -> None:
        with aot_kernel._locked(package):
            entered.set()

    with caplog.at_level(logging.INFO, logger="kvguard.engine_patch.aot_kernel"):
        with open(package.with_suffix(".lock"), "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            waiter = threading.Thread(target=wait_for_the_lock)
            waiter.start()
            deadline = time.monotonic() + 30
            while "Waiting for another process's build" not in caplog.text:
                assert time.monotonic() < deadline, "no wait was logged"
                time.sleep(0.01)
            assert not entered.is_set()
        waiter.join(30)
    assert entered.is_set()


def test_a_kernel_that_fails_in_a_pass_is_not_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(checksum_kernel, "_compile_failed", False)
    layers = tiny_llama_layers()
    worker = KVChecksumWorker(layers, compile=True)
    worker.warm_up()
    assert worker.compiled
    calls = 0

    def broken(self: aot_kernel.HostKernel, *args: Any) -> np.ndarray:
        nonlocal calls
        calls += 1
        raise RuntimeError("the runner broke")

    monkeypatch.setattr(aot_kernel.HostKernel, "__call__", broken)
    # Both steps right (eager), and the broken kernel tried only once.
    assert_equals_eager(worker, layers)
    assert calls == 1
    assert not worker.compiled
