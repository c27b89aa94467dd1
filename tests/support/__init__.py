"""Helpers every test suite shares: free ports, /metrics scraping and
starting the repository's scripts.

Reached as ``tests.support`` through pytest's ``pythonpath`` setting (the
repository root); proxies and engines in process come from
``proxy.testing`` and ``fake_engine.testing``.
"""

from pathlib import Path

# The repository's root, whatever the test's directory.
REPO = Path(__file__).resolve().parents[2]
