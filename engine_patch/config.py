"""Configuration of KV checksums in an engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVChecksumConfig:
    """KV checksum settings of one engine instance.

    ``fail_closed`` (the default): a mismatched or unverified load fails
    (the host handles it by its KV load failure policy). Fail-open
    (``False``) is an explicit opt-in for rollouts: it logs and counts such a
    load and lets the request go on with it; a mismatched load's blocks must
    still never serve another request
    (:meth:`~engine_patch.scheduler.KVChecksumScheduler.take_mismatched_loads`).
    """

    tp_size: int = 1
    pp_size: int = 1
    enabled: bool = True
    fail_closed: bool = True
