"""The repository's own checks: pre-commit runs `make lint` and `make typecheck`."""

from __future__ import annotations

import re
import shlex

import yaml
from ops_helpers import REPO


def _recipe(target: str) -> list[list[str]]:
    """The commands of a Makefile target, ``$(BIN)/`` spelled ``.venv/bin/``."""
    text = (REPO / "Makefile").read_text()
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M)
    assert match, f"no target {target} in the Makefile"
    return [
        shlex.split(line.strip().replace("$(BIN)/", ".venv/bin/"))
        for line in match.group(1).splitlines()
    ]


def test_pre_commit_hooks_run_what_make_lint_and_typecheck_run() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    entries = [shlex.split(hook["entry"]) for hook in hooks]
    for hook in hooks:
        assert hook["language"] == "system"  # the venv's tools, no download
    # ruff gets the staged files; `make lint` gives it the whole tree (".").
    lint = [cmd[:-1] if cmd[-1] == "." else cmd for cmd in _recipe("lint")]
    assert entries == [*lint, *_recipe("typecheck")]
    mypy = next(hook for hook in hooks if hook["id"] == "mypy")
    assert mypy["pass_filenames"] is False  # the packages, as configured
