"""Debian programs some tests run (dnsmasq, Prometheus, Chromium): each
found on the PATH, or the test skipped saying which package brings it
(``.ci/run`` installs them)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support import REPO

# KVGuard's alerting rules and their promtool unit tests.
ALERT_RULES = REPO / "deploy" / "prometheus" / "kvguard-rules.yaml"
ALERT_RULE_TESTS = REPO / "deploy" / "prometheus" / "kvguard-rules.test.yaml"


def need(program: str, package: str) -> str:
    """The path of ``program``, or skip: ``apt-get install PACKAGE`` brings it."""
    path = shutil.which(program)
    if path is None:
        pytest.skip(f"{program} not found: apt-get install {package} (.ci/run does)")
    return path


def promtool(*args: str) -> str:
    """promtool's output for ``args``; fails the test where it exits non-zero."""
    done = subprocess.run(
        [need("promtool", "prometheus"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output
