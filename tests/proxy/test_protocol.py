"""The proxy's wire constants agree with what the engines send (mirrors)."""

from __future__ import annotations

from engine_patch.scheduler import KV_CHECKSUM_FAILURE_TEXT
from proxy.protocol import INTEGRITY_MARKER


def test_the_proxy_looks_for_the_text_the_engines_put_in_a_failed_load() -> None:
    # The proxy imports nothing of engine_patch, so the text is written twice.
    assert INTEGRITY_MARKER == KV_CHECKSUM_FAILURE_TEXT
