"""Counts of verification outcomes, for the host's metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class KVChecksumStats:
    """Outcomes since start: loads verified, mismatched, and unverified by
    reason (the scheduler's fixed reason texts); producer sends with
    checksums, and sends without by reason."""

    verified: int = 0
    mismatch: int = 0
    unverified: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    not_sent: Counter[str] = field(default_factory=Counter)
