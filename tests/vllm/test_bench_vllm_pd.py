"""benchmarks/bench_vllm_pd.py still starts: it imports the real-vLLM test
helpers (``vllm_servers``, ``vllm_client``) and vLLM, and parses its
options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm_pd.py"


def test_bench_vllm_pd_starts() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--scheduler-cost" in result.stdout
