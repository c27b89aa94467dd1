"""The benchmarks still start: each script imports what it uses and parses
its options (``--help``). bench_vllm_pd.py needs vLLM and is checked in the
real-vLLM suite (tests/vllm/test_bench_vllm_pd.py)."""

from __future__ import annotations

import pytest

from tests.support.scripts import script_help


@pytest.mark.parametrize(
    "script",
    [
        "bench_checksum.py",
        "bench_ejection.py",
        "bench_fake_engine.py",
        "bench_proxy.py",
    ],
)
def test_benchmark_script_starts(script: str) -> None:
    assert "usage:" in script_help(f"benchmarks/{script}")
