"""benchmarks/bench_vllm_pd.py still starts: it imports the real-vLLM test
helpers (``vllm_servers``, ``vllm_client``) and parses its options."""

from __future__ import annotations

import pytest

from tests.support.scripts import script_help

pytestmark = pytest.mark.vllm


def test_bench_vllm_pd_starts() -> None:
    usage = script_help("benchmarks/bench_vllm_pd.py")
    assert "--scheduler-cost" in usage
    assert "--pollers" in usage
