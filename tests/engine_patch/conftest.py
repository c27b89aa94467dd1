"""Fixtures of the engine_patch tests."""

from __future__ import annotations

import pytest

from engine_patch import log


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(log, "_warned", set())
