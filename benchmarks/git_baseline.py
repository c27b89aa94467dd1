"""Source files as of a git revision, for benchmarks that time this tree
against a baseline in the same run."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def source_at(rev: str, path: str) -> str | None:
    """The text of ``path`` (from the repository's root) at git revision
    ``rev``, or None outside a git checkout that has it."""
    try:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
