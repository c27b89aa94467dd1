"""The benchmarks still start: each script imports what it uses and parses
its options (``--help``). bench_vllm_pd.py needs vLLM and is checked in the
real-vLLM suite (tests/vllm/test_bench_vllm_pd.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ops_helpers import REPO


@pytest.mark.parametrize(
    "script", ["bench_checksum.py", "bench_fake_engine.py", "bench_proxy.py"]
)
def test_benchmark_script_starts(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
