"""Reading Prometheus /metrics text with prometheus_client's own parser."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``.

    ``name`` is a sample's full name (``kvguard_proxy_retries_total``); 0
    when none matches.
    """
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return total


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    """The /metrics text of the server at base URL ``url``."""
    async with session.get(url + "/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


async def fetch_metric(
    session: aiohttp.ClientSession, url: str, name: str, **labels: str
) -> float:
    """``metric`` of the /metrics of the server at base URL ``url``."""
    return metric(await scrape(session, url), name, **labels)
