"""Fixtures for the proxy's tests (helpers live in proxy_helpers.py)."""

from proxy_helpers import stubs

__all__ = ["stubs"]
