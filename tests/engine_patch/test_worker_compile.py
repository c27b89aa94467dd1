"""The fused (torch.compile) checksum kernel gives the eager kernel's bits.

Compiling takes a few seconds per row shape with a warm inductor cache and
about 20 s without; set KVGUARD_SKIP_COMPILE_TESTS=1 to skip it.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters
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

from engine_patch import checksum_kernel
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


def test_after_warm_up_no_pass_compiles_again() -> None:
    # A compile inside an engine step stalls the engine for seconds (tens
    # with a cold cache), long enough for a producer's KV lease to lapse.
    # The warm-up passes two blocks then one, and this model has two KV
    # heads and two layers: dims that happen to be equal at the first
    # compile must not be taken for one.
    layers = layers_in_one_buffer(
        KVLayout.PACKED_HND,
        torch.bfloat16,
        num_layers=2,
        num_blocks=24,
        block_size=16,
        heads=2,
        last=64,
    )
    compiled = KVChecksumWorker(layers, compile=True)
    compiled.warm_up()
    assert compiled.compiled
    graphs = counters["stats"]["unique_graphs"]
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
    assert counters["stats"]["unique_graphs"] == graphs
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


def test_compile_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(checksum_kernel.COMPILE_ENV, "1")
    assert checksum_kernel.compile_default()
    monkeypatch.setenv(checksum_kernel.COMPILE_ENV, "0")
    assert not checksum_kernel.compile_default()
    monkeypatch.delenv(checksum_kernel.COMPILE_ENV)
    assert not checksum_kernel.compile_default()


def test_the_kernel_compiles_into_the_cache_dir_it_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/host/engine/cache")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv(checksum_kernel.CACHE_DIR_ENV, str(tmp_path))
    assert checksum_kernel.cache_dir() == str(tmp_path)
    with checksum_kernel._inductor_cache():
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
