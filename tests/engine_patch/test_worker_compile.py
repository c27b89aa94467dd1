"""The fused (torch.compile) checksum kernel gives the eager kernel's bits.

Compiling takes a few seconds with a warm inductor cache and about 20 s
without; set KVGUARD_SKIP_COMPILE_TESTS=1 to skip it.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_worker import load_values, make_kv

from engine_patch import checksum_kernel
from engine_patch.worker import KVChecksumWorker, KVLayer, KVLayout

pytestmark = pytest.mark.skipif(
    os.environ.get("KVGUARD_SKIP_COMPILE_TESTS") == "1",
    reason="KVGUARD_SKIP_COMPILE_TESTS=1",
)


def test_compiled_kernel_equals_eager() -> None:
    layers = [
        KVLayer(
            "a",
            0,
            0,
            make_kv(KVLayout.SPLIT, torch.bfloat16, "shared_buffer"),
            KVLayout.SPLIT,
        ),
        # Not viewable as pieces in place: gathered, then the same kernel.
        KVLayer(
            "b",
            1,
            0,
            make_kv(KVLayout.PACKED_HND, torch.uint8, "strided_last_dim", seed=1),
            KVLayout.PACKED_HND,
            head_offset=2,
        ),
    ]
    compiled = KVChecksumWorker(layers, compile=True)
    eager = KVChecksumWorker(layers, compile=False)
    for start, ids, num_tokens in [(0, [3, 5, 1], 10), (2, [7], 9), (1, [0, 2], 12)]:
        expected = load_values(eager, num_tokens, start, ids).values
        assert (load_values(compiled, num_tokens, start, ids).values == expected).all()
    # The compiled kernel really ran.
    assert checksum_kernel.compiled_block_sums() is not None


def test_compile_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(checksum_kernel.COMPILE_ENV, "1")
    assert checksum_kernel.compile_default()
    monkeypatch.setenv(checksum_kernel.COMPILE_ENV, "0")
    assert not checksum_kernel.compile_default()
