"""``kvguard demo`` runs end to end and exits 0 only when every answer was right."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")


async def test_demo_catches_every_corrupted_load_and_exits_0(capsys):
    from kvguard.demo import main

    status = await asyncio.to_thread(main, ["--requests", "16", "--concurrency", "2"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "16 / 16" in out
    assert "faulty prefill ejected                   yes" in out
