"""benchmarks/bench_kernel_forms.py: every form of the fused kernel it
times on a GPU gives the CPU eager pass's values (checked here on a CPU's
device path), and it prints a figure per form. The Triton form runs where
Triton is installed, under its interpreter."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.skipif(
    os.environ.get("KVGUARD_SKIP_COMPILE_TESTS") == "1",
    reason="KVGUARD_SKIP_COMPILE_TESTS=1",
)


def run_forms(forms: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/bench_kernel_forms.py"),
            *("--device", "cpu", "--kv-gib", "0.004", "--reps", "1"),
            *("--small-reps", "2", "--dtypes", "bfloat16,uint8", "--forms", forms),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_each_torch_form_gives_the_workers_values_and_a_figure() -> None:
    out = run_forms("now,static rows,by span,pieces first")
    for form in ("now", "static rows", "by span", "pieces first"):
        assert re.search(rf"^{form} +same +\d+ +[\d.]+ ", out, re.M), out


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)
def test_the_triton_form_gives_the_workers_values_interpreted() -> None:
    out = run_forms("now,triton", {"TRITON_INTERPRET": "1"})
    assert re.search(r"^triton +same ", out, re.M), out
