"""Logging helpers for engine_patch: warnings logged once per process."""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()
# (logger name, formatted message) of the warnings already logged.
_warned: set[tuple[str, str]] = set()


def warning_once(logger: logging.Logger, msg: str, *args: object) -> None:
    """Log a warning the first time ``logger`` has this message text in this
    process, like vLLM's ``logger.warning_once``: for conditions that recur
    with every request, whose per-request detail goes to debug."""
    key = (logger.name, msg % args if args else msg)
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)
