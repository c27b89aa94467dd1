"""engine_patch's log records through vLLM's handlers, so that KVGuard's
messages appear in vLLM's log with its format and level."""

from __future__ import annotations

import logging


def use_vllm_handlers() -> None:
    """Give the ``kvguard`` logger, under which every engine_patch module
    logs, vLLM's handlers and level, once per process (vLLM configures only
    its own ``vllm`` logger)."""
    ours = logging.getLogger("kvguard")
    vllm = logging.getLogger("vllm")
    if ours.handlers or not vllm.handlers:
        return
    for handler in vllm.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm.getEffectiveLevel())
    ours.propagate = False
