"""The proxy's base install has no torch: importing it must not need any."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "engine_patch", "fake_engine")


@pytest.mark.parametrize(
    "module", ["proxy", "proxy.app", "proxy.cli", "proxy.testing", "kvguard.cli"]
)
def test_importing_the_proxy_loads_no_torch_numpy_or_engine_patch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
