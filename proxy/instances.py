"""Backend instances, their pools, and the state routing reads.

An Instance outlives configuration reloads while its (model, role, url) stays
configured, so its in-flight count and health carry over; requests in flight
keep their Instance even after it is removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yarl import URL

from proxy.config import Role

Key = tuple[str, str, str]
"""(model, role, url): what names an instance across reloads and DNS lookups."""


class Instance:
    """One backend and the live state the proxy keeps about it."""

    __slots__ = (
        "abort_url",
        "admitted",
        "api_key",
        "consecutive_failures",
        "consecutive_successes",
        "context_lens",
        "discovered_by",
        "drained",
        "ejected_until",
        "ejections",
        "failed_at",
        "headers",
        "healthy",
        "in_flight",
        "model",
        "prefills_without_kv",
        "removed",
        "role",
        "rr_current",
        "url",
        "urls",
        "weight",
    )

    def __init__(
        self,
        url: str,
        role: Role,
        model: str,
        weight: float = 1.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url
        self.role: Role = role
        self.model = model
        self.weight = weight
        self.api_key = api_key
        base = URL(url)
        # Pre-built request URLs: yarl parsing per request is measurable.
        self.urls = {
            "/v1/completions": base / "v1" / "completions",
            "/v1/chat/completions": base / "v1" / "chat" / "completions",
        }
        self.abort_url = base / "inference" / "v1" / "abort_requests"
        self.headers: dict[str, str] = {}
        self.set_api_key(api_key)
        self.in_flight = 0
        self.healthy = True
        # Once in rotation, healthy_threshold passes bring it back from a
        # failure; one that never was (probed as it joins) needs one pass.
        self.admitted = True
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.failed_at = 0.0  # monotonic time of the last failure noted
        self.drained = False
        self.removed = False
        self.ejected_until = 0.0  # 0: not ejected; else cooldown end (monotonic)
        self.ejections = 0
        # Prefills it answered without kv_transfer_params (a prefill only).
        self.prefills_without_kv = 0
        self.rr_current = 0.0
        # The ``dns:`` entry (host:port) that found this instance; None if configured.
        self.discovered_by: str | None = None
        # Served model id -> max_model_len, from its /v1/models (decodes only,
        # by the health checks); empty while unknown.
        self.context_lens: dict[str, int] = {}

    def set_api_key(self, api_key: str | None) -> None:
        self.api_key = api_key
        # Sent on every call; vLLM rejects bodies not labelled application/json.
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    @property
    def key(self) -> Key:
        return self.model, self.role, self.url

    @property
    def ejected(self) -> bool:
        """Out for integrity failures: cooling down or awaiting its probe."""
        return self.ejected_until != 0.0

    def usable(self) -> bool:
        """Healthy, in service and not drained (ejection aside)."""
        return self.healthy and not self.drained and not self.removed

    def max_model_len(self, model: str | None) -> int | None:
        """The context length this instance serves ``model`` with (None: its
        default), or None when its /v1/models did not say."""
        lens = self.context_lens
        if model is not None:
            return lens.get(model)
        values = set(lens.values())
        return values.pop() if len(values) == 1 else None

    def load(self) -> float:
        return self.in_flight / self.weight

    def describe(self, now: float) -> dict[str, Any]:
        """The admin API's view of this instance."""
        return {
            "model": self.model,
            "role": self.role,
            "url": self.url,
            "weight": self.weight,
            "healthy": self.healthy,
            "drained": self.drained,
            "ejected": self.ejected,
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3)
            if self.ejected
            else 0.0,
            "ejections": self.ejections,
            "in_flight": self.in_flight,
            "discovered_by": self.discovered_by,
            "max_model_len": dict(self.context_lens),
        }

    def __repr__(self) -> str:
        return f"Instance({self.role} {self.url})"


@dataclass(slots=True)
class Pool:
    """The instances of one role for one model; the list is replaced, never mutated."""

    role: Role
    policy: str
    instances: list[Instance] = field(default_factory=list)


def short_contexts(
    pool: Pool, model: str | None, tokens: int
) -> tuple[frozenset[Instance], int | None]:
    """The usable instances of ``pool`` known to serve ``model`` with a
    context shorter than ``tokens``, and, when every usable one is, the
    longest of their contexts (else None: some instance may serve them)."""
    short: list[Instance] = []
    longest = 0
    every = True
    for inst in pool.instances:
        if not inst.usable():
            continue
        length = inst.max_model_len(model)
        if length is None or length >= tokens:
            every = False
            continue
        short.append(inst)
        longest = max(longest, length)
    return frozenset(short), (longest if every and short else None)


@dataclass(slots=True)
class ModelPools:
    prefill: Pool
    decode: Pool

    def pool(self, role: Role) -> Pool:
        return self.prefill if role == "prefill" else self.decode
