"""Instance health: active GET /health probes and passive request outcomes.

Consecutive failures past ``unhealthy_threshold`` take an instance out;
``healthy_threshold`` passing probes bring it back. What counts is what says
something about the instance: a failed probe, a connection failure, and,
once another attempt has served the request, a leg's timeout or a failure
it answered that did not repeat elsewhere (once per request, never against
an instance that served it; the flow decides, see ``Flow._settle``). An
instance ejected for integrity failures returns only after its cooldown
*and* a passing probe.
An instance is probed before it takes traffic: at startup, before the proxy
listens; added to a serving proxy (admin API, reload), before it joins. It
takes traffic only once a probe passes, as a new DNS address does: one
pass, however many probes it failed before (still loading its model, say).
After each passing probe of a decode its ``/v1/models`` is read too, for
the context length the flow checks output budgets against.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

import aiohttp
from yarl import URL

from proxy.config import HealthConfig
from proxy.instances import Instance
from proxy.served import context_lens, served_models
from proxy.upstream import ReplyTooLarge, read_capped

if TYPE_CHECKING:
    from proxy.state import ProxyState

log = logging.getLogger("kvguard.proxy.health")

# What a probe reads of a /health body (vLLM's is empty).
_MAX_BODY = 65536


class Health:
    """Tracks and probes the state's instances."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def note(self, inst: Instance, ok: bool) -> None:
        """An outcome on ``inst``: failures count to unhealthy, a success resets."""
        if ok:
            inst.consecutive_failures = 0
            return
        cfg = self.state.config.health
        inst.failed_at = time.monotonic()
        inst.consecutive_successes = 0
        inst.consecutive_failures += 1
        if (
            cfg.enabled
            and inst.healthy
            and inst.consecutive_failures >= cfg.unhealthy_threshold
        ):
            inst.healthy = False
            log.warning(
                "%s %s marked unhealthy after %d consecutive failures",
                inst.role,
                inst.url,
                inst.consecutive_failures,
            )

    def _probed(
        self,
        inst: Instance,
        ok: bool,
        started: float,
        cfg: HealthConfig | None = None,
    ) -> None:
        """Applies a probe sent at ``started``; a pass is stale, and ignored,
        when a failure was noted on ``inst`` since (the instance may have
        died after answering)."""
        cfg = cfg or self.state.config.health
        if not ok:
            self.note(inst, ok=False)
            return
        if inst.failed_at >= started:
            return
        inst.consecutive_failures = 0
        inst.consecutive_successes += 1
        needed = cfg.healthy_threshold if inst.admitted else 1
        if not inst.healthy and inst.consecutive_successes >= needed:
            inst.healthy = inst.admitted = True
            log.warning("%s %s healthy", inst.role, inst.url)
        if inst.ejected and time.monotonic() >= inst.ejected_until:
            inst.ejected_until = 0.0
            log.warning(
                "%s %s back from ejection after a passing probe", inst.role, inst.url
            )

    async def probe(
        self, url: str, headers: dict[str, str], cfg: HealthConfig | None = None
    ) -> bool:
        """True when GET ``url`` + health path answers 2xx within the timeout
        (of ``cfg``, by default the running configuration's)."""
        cfg = cfg or self.state.config.health
        try:
            async with self.state.session.get(
                URL(url + cfg.path),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
            ) as resp:
                ok = 200 <= resp.status < 300
                # Read so the connection is reused; a larger body closes it.
                with contextlib.suppress(ReplyTooLarge):
                    await read_capped(resp, _MAX_BODY)
                return ok
        except (TimeoutError, aiohttp.ClientError, ValueError):
            # ValueError: a URL that yarl refuses.
            return False

    async def probe_instance(
        self, inst: Instance, cfg: HealthConfig | None = None
    ) -> bool:
        """Probes ``inst``, a new instance out of rotation, now and applies
        the result: one pass admits it (``healthy_threshold`` counts the
        passes that bring an admitted instance *back*), unless a failure was
        noted on it since the probe was sent."""
        started = time.monotonic()
        ok = await self.probe(inst.url, inst.headers, cfg)
        self._probed(inst, ok, started, cfg)
        if ok:
            await self.read_context_lens([inst], cfg)
        return ok

    async def first_probe(
        self, joining: Collection[Instance], cfg: HealthConfig | None = None
    ) -> None:
        """Judges ``joining``, instances about to take traffic (the
        configured ones at startup, or ones joining a serving proxy's pools),
        by one probe each (:meth:`probe_instance`), sent now, all at once:
        with health checks on (in ``cfg``, the configuration they join under)
        each takes traffic only once a probe passes, and a healthy one waits
        one probe, not a round. With health checks off nothing would probe
        them in: they join as they are."""
        cfg = cfg or self.state.config.health
        if not cfg.enabled:
            return
        for inst in joining:
            inst.healthy = inst.admitted = False
        await asyncio.gather(*(self.probe_instance(i, cfg) for i in joining))

    async def check_all(self) -> None:
        """Probes every distinct URL once; each result applies to its URL's
        instances as soon as it comes, not after the round's slowest probe."""
        by_url: dict[str, list[Instance]] = {}
        for inst in self.state.all_instances():
            by_url.setdefault(inst.url, []).append(inst)

        async def check(instances: list[Instance]) -> None:
            started = time.monotonic()
            ok = await self.probe(instances[0].url, instances[0].headers)
            for inst in instances:
                self._probed(inst, ok, started)
            if ok:
                await self.read_context_lens(instances)

        await asyncio.gather(*(check(instances) for instances in by_url.values()))

    async def read_context_lens(
        self, instances: list[Instance], cfg: HealthConfig | None = None
    ) -> None:
        """Sets the context lengths of the decodes among ``instances`` (one
        URL) from its ``/v1/models``, read once; unknown (empty) when it
        does not say. A prefill's is never read: the prefill leg asks for
        one token."""
        decodes = [i for i in instances if i.role == "decode"]
        if not decodes:
            return
        cfg = cfg or self.state.config.health
        entries = await served_models(
            self.state.session,
            decodes[0],
            cfg.timeout_s,
            self.state.config.limits.max_reply_bytes,
        )
        lens = context_lens(entries)
        for inst in decodes:
            inst.context_lens = lens

    async def run(self, *, probed: bool = False) -> None:
        """Probes forever at the configured interval (cancel to stop); the
        first round one interval from now if every instance was just
        ``probed``."""
        if probed:
            await asyncio.sleep(self.state.config.health.interval_s)
        while True:
            cfg = self.state.config.health
            if cfg.enabled:
                try:
                    await self.check_all()
                except Exception:  # a probe bug must not end health checking
                    log.exception("health check round failed")
            await asyncio.sleep(cfg.interval_s)
