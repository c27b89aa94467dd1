"""The repository's scripts as a user starts them."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO


def run_script(relative_path: str, *options: str, timeout_s: float = 300) -> str:
    """Run ``python <script> <options>`` from the repository and return what
    it printed.

    Raises:
        AssertionError: If the script exits with an error.
    """
    result = subprocess.run(
        [sys.executable, str(REPO / relative_path), *options],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def script_help(relative_path: str, timeout_s: float = 300) -> str:
    """Run ``python <script> --help`` from the repository and return what it
    printed: a script that starts imports everything it uses.

    Raises:
        AssertionError: If the script exits with an error.
    """
    return run_script(relative_path, "--help", timeout_s=timeout_s)
