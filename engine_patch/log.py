"""Logging helpers for engine_patch and the fake engine: loggers under
``kvguard.``, and warnings logged once per process."""

from __future__ import annotations

import logging
import threading

_lock = threading.Lock()
# (logger name, formatted message) of the warnings already logged.
_warned: set[tuple[str, str]] = set()


def get_logger(module_name: str) -> logging.Logger:
    """The logger of a module, ``kvguard.`` + its name (``__name__``), so that
    configuring ``logging.getLogger("kvguard")`` configures all of KVGuard's
    (the proxy's loggers are ``kvguard.proxy...``)."""
    return logging.getLogger("kvguard." + module_name)


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
