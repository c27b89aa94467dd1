"""The benchmarks still start: each script imports what it uses and parses
its options (``--help``). bench_vllm_pd.py needs vLLM and is checked in the
real-vLLM suite (tests/vllm/test_bench_vllm_pd.py). bench_proxy.py also runs
a short interleaved run, and its ratios are checked."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from ops_helpers import need

from tests.support import REPO
from tests.support.scripts import run_script, script_help


@pytest.mark.parametrize(
    "script",
    [
        "bench_checksum.py",
        "bench_ejection.py",
        "bench_fake_engine.py",
        "bench_proxy.py",
        "bench_sse.py",
    ],
)
def test_benchmark_script_starts(script: str) -> None:
    assert "usage:" in script_help(f"benchmarks/{script}")


def _load_bench_proxy() -> ModuleType:
    """benchmarks/bench_proxy.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_proxy", REPO / "benchmarks/bench_proxy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses resolve their annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_proxy_takes_each_ratio_within_a_round_and_prints_its_spread() -> None:
    bench = _load_bench_proxy()

    def result(target: str, rnd: int, rps: float, cpu: float, errors: int = 0):
        return bench.Result(
            target, "stream", 100, errors, 1.0, rps, 10.0, 20.0, rnd, cpu
        )

    results = [
        result("kvguard-proxy", 0, 200.0, 0.9),
        result("vllm-router", 0, 100.0, 1.0),
        result("kvguard-proxy", 1, 100.0, 2.0),
        result("vllm-router", 1, 100.0, 1.0),
        result("kvguard-proxy", 2, 150.0, 1.2),
        result("vllm-router", 2, 100.0, 1.0),
        result("kvguard-proxy", 3, 900.0, 0.1, errors=1),  # left out
        result("vllm-router", 3, 100.0, 1.0),
    ]
    (line,) = bench.ratios(results)
    assert line.startswith("stream     kvguard-proxy / vllm-router, 3 rounds: ")
    assert "1.50x (1.00-2.00) req/s" in line
    assert "CPU per request 1.20x (0.90-2.00)" in line
    assert line.endswith("(1 round(s) with errors left out)")
    only_errors = [r for r in results if r.round == 3]
    assert bench.ratios(only_errors) == ["stream     vs vllm-router: errors, no ratio"]


def test_bench_proxy_runs_its_targets_in_interleaved_rounds() -> None:
    stdout = _run_bench_proxy(
        "--rounds", "2", "--duration", "0.5", "--baseline", str(REPO)
    )
    runs = [line.split()[:3] for line in stdout.splitlines()]
    # Round 1 starts with the next target: load from elsewhere falls alike.
    assert ["r0", "direct-decode", "non-stream"] in runs
    assert runs.index(["r1", "kvguard-proxy", "non-stream"]) < runs.index(
        ["r1", "direct-decode", "non-stream"]
    )
    assert ["r0", "kvguard-baseline", "stream"] in runs
    for mode in ("non-stream", "stream"):
        for other in ("direct-decode", "kvguard-baseline"):
            assert f"{mode:10s} kvguard-proxy / {other}, 2 rounds: " in stdout


def _run_bench_proxy(*options: str) -> str:
    """A short bench_proxy run against KVGuard's proxy alone: its stdout.

    Raises:
        AssertionError: the run failed.
    """
    return run_script(
        "benchmarks/bench_proxy.py",
        "--skip-router",
        "--requests",
        "12",
        "--concurrency",
        "2",
        "--warmup",
        "2",
        *options,
        timeout_s=600,
    )


def test_bench_proxy_counts_instructions_per_request_under_callgrind() -> None:
    need("valgrind", "valgrind")
    need("callgrind_control", "valgrind")
    out = _run_bench_proxy("--instructions", "--duration", "120")
    counts = {}
    for line in out.splitlines():
        words = line.split()
        if words[:2] == ["r0", "kvguard-proxy"] and "instructions/req" in line:
            assert "errors 0/12" in line
            counts[words[2]] = float(words[words.index("M") - 1])
    # About a million per request (here 1.3-2.2 M, warm-up effects included);
    # the run's total, 12 requests' worth, would be over 8.
    assert set(counts) == {"non-stream", "stream"}
    assert all(0.2 < c < 8 for c in counts.values()), counts
    assert "direct-decode" not in out  # no proxy there to count
