"""benchmarks/bench_vllm_pd.py still starts: it imports the real-vLLM test
helpers (``vllm_servers``, ``vllm_client``) and parses its options."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.scripts import script_help

pytestmark = pytest.mark.vllm


def test_bench_vllm_pd_starts() -> None:
    usage = script_help("benchmarks/bench_vllm_pd.py")
    assert "--scheduler-cost" in usage
    assert "--pollers" in usage


def test_scheduler_breakdown_times_each_call_of_both_roles() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/bench_vllm_pd.py"),
            "--scheduler-breakdown",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^producer, 64 blocks: [\d.]+ us per request", out, re.M)
    assert re.search(r"^consumer, 64 blocks: [\d.]+ us per request", out, re.M)
    for call in (
        "KVGuardSchedulerSide._flush",
        "KVChecksumComparer.payload",
        "KVGuardSchedulerSide._on_alloc",
        "KVChecksumComparer.compare",
    ):
        assert re.search(rf"^  {re.escape(call)} +[\d.]+ us/request", out, re.M), call
