"""Instance health: active GET /health probes and passive request outcomes.

Consecutive failures past ``unhealthy_threshold`` take an instance out;
``healthy_threshold`` passing probes bring it back. What counts is what says
something about the instance: a failed probe, a connection failure or
timeout, and a request that failed on it but not alike elsewhere (once per
request; the flow decides, see ``Flow._serve``). An instance ejected for
integrity failures returns only after its cooldown *and* a passing probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
from yarl import URL

from proxy.instances import Instance

if TYPE_CHECKING:
    from proxy.state import ProxyState

log = logging.getLogger("kvguard.proxy.health")


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

    def _probed(self, inst: Instance, ok: bool) -> None:
        cfg = self.state.config.health
        if not ok:
            self.note(inst, ok=False)
            return
        inst.consecutive_failures = 0
        inst.consecutive_successes += 1
        if not inst.healthy and inst.consecutive_successes >= cfg.healthy_threshold:
            inst.healthy = True
            log.warning("%s %s healthy again", inst.role, inst.url)
        if inst.ejected and time.monotonic() >= inst.ejected_until:
            inst.ejected_until = 0.0
            log.warning(
                "%s %s back from ejection after a passing probe", inst.role, inst.url
            )

    async def probe(self, url: str, headers: dict[str, str]) -> bool:
        """True when GET ``url`` + health path answers 2xx within the timeout."""
        cfg = self.state.config.health
        try:
            async with self.state.session.get(
                URL(url + cfg.path),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
            ) as resp:
                await resp.read()
                return 200 <= resp.status < 300
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def probe_instance(self, inst: Instance) -> bool:
        """Probes ``inst`` now and applies the result (a new instance's way in)."""
        ok = await self.probe(inst.url, inst.headers)
        self._probed(inst, ok)
        return ok

    async def check_all(self) -> None:
        """Probes every distinct URL once and applies the result to its instances."""
        by_url: dict[str, list[Instance]] = {}
        for inst in self.state.all_instances():
            by_url.setdefault(inst.url, []).append(inst)
        if not by_url:
            return
        urls = list(by_url)
        results = await asyncio.gather(
            *(self.probe(u, by_url[u][0].headers) for u in urls)
        )
        for url, ok in zip(urls, results, strict=True):
            for inst in by_url[url]:
                self._probed(inst, ok)

    async def run(self) -> None:
        """Probes forever at the configured interval (cancel to stop)."""
        while True:
            cfg = self.state.config.health
            if cfg.enabled:
                try:
                    await self.check_all()
                except Exception:  # a probe bug must not end health checking
                    log.exception("health check round failed")
            await asyncio.sleep(cfg.interval_s)
