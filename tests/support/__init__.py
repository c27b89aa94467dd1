"""Helpers every test suite shares: free ports and /metrics scraping.

Reached as ``tests.support`` through pytest's ``pythonpath`` setting (the
repository root); proxies and engines in process come from
``proxy.testing`` and ``fake_engine.testing``.
"""
