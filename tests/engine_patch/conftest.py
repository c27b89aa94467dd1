"""Fixtures of the engine_patch tests."""

from __future__ import annotations

import pytest

from engine_patch import log
from engine_patch.worker import KVChecksumWorker


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(log, "_warned", set())


@pytest.fixture(params=[True, False], ids=["host-pass", "torch-pass"])
def both_passes(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> bool:
    """Workers made in the test run their eager CPU passes in numpy (the
    default) or in torch's ops, as they do on accelerators: both must give
    the reference's values."""
    defaults = KVChecksumWorker.__init__.__kwdefaults__
    assert defaults is not None and "host_pass" in defaults
    monkeypatch.setitem(defaults, "host_pass", request.param)
    return bool(request.param)
