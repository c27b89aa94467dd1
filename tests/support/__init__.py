"""Helpers every test suite shares: free ports, /metrics scraping and
starting the repository's scripts.

Reached as ``tests.support`` through pytest's ``pythonpath`` setting (the
repository root); proxies and engines in process come from
``proxy.testing`` and ``fake_engine.testing``.
"""
