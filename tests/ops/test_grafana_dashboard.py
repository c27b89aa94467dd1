"""deploy/grafana: the dashboard's queries name only metrics that are exported.

The proxy and the fake engine are scraped for real after traffic through a
corrupting prefill (their failure counters exist only once something failed).
The vLLM connector's metric names are read from engine_patch/vllm/stats.py's
source: importing it needs vLLM, which ``make test``'s environment does not
have (the real-vLLM suite runs them).
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import time

import aiohttp
import pytest
from ops_helpers import DEPLOY, REPO, complete
from prometheus_client.parser import text_string_to_metric_families

from proxy.testing import running_proxy
from tests.support.metrics import metric

DASHBOARD = DEPLOY / "grafana" / "kvguard-dashboard.json"

# PromQL words that are not metric names.
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\{[^}]*\}", "", text)  # matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text
    )
    text = re.sub(r"\$\w+", "", text)  # dashboard variables
    text = re.sub(r"(?<![\w:])\d[\d.]*(e[+-]?\d+)?[a-z]*", "", text)  # numbers, 5m
    names = set()
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", text):
        name, call = match.groups()
        if call or name in _KEYWORDS or re.fullmatch(r"\d.*", name):
            continue
        names.add(name)
    return names


def _queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query, variables included."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert found, var["definition"]
            queries.append((f"${var['name']}", found.group(1)))
    return queries


def vllm_connector_metrics() -> set[str]:
    """Names KVGuardPromMetrics registers (as Prometheus exposes counters)."""
    source = (REPO / "engine_patch" / "vllm" / "stats.py").read_text()
    tree = ast.parse(source)
    (cls,) = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "KVGuardPromMetrics"
    ]
    names = set()
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("counter", "by_reason")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(f"{node.args[0].value}_total")
    assert "kvguard_kv_checksum_bytes_total" in names, "stats.py changed shape"
    return names


def _sample_names(exposition: str) -> set[str]:
    return {
        sample.name
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


async def _scrape_after_traffic() -> dict[str, str]:
    """/metrics of the proxy and each fake engine (by role) after traffic."""
    pytest.importorskip("torch")
    from fake_engine.config import FaultConfig, FaultKind, FaultSide, Role
    from fake_engine.testing import EngineSpec, fake_engines

    corrupting = FaultConfig(fault=FaultKind.BITFLIP, side=FaultSide.PRODUCER)
    specs = (
        EngineSpec(role=Role.PRODUCER),
        EngineSpec(role=Role.PRODUCER, fault=corrupting),
        # Not a producer: its prefills come back without kv_transfer_params.
        EngineSpec(role=Role.CONSUMER),
        EngineSpec(role=Role.CONSUMER, fail_closed=True),
    )
    async with fake_engines(*specs) as urls:
        good, bad, no_kv, decode = urls
        prefills = [{"url": good}, {"url": bad}, {"url": no_kv}]
        config = {
            "models": {
                "*": {
                    "prefill": {"instances": prefills},
                    "decode": {"instances": [{"url": decode}]},
                }
            },
            "retry": {"backoff_base_s": 0.002},
            "ejection": {"instance_failures": 2, "pair_failures": 2},
        }
        async with running_proxy(config) as proxy, aiohttp.ClientSession() as http:
            answers = await asyncio.gather(
                *(complete(http, proxy.url, f"q{i}", i % 2 == 0) for i in range(8))
            )
            assert all(status == 200 for status, _ in answers)
            texts = {}
            for role, url in zip(
                ("proxy", "prefill", "bad prefill", "no-kv prefill", "decode"),
                (proxy.url, *urls),
                strict=True,
            ):
                async with http.get(url + "/metrics") as resp:
                    texts[role] = await resp.text()
    return texts


def test_the_metric_lexer_finds_names_and_only_names():
    assert metric_names(
        'histogram_quantile(0.99, sum by (le, leg) (rate(a_bucket{job=~"$job",'
        'x="by (y)"}[$__rate_interval]))) / on(job) b_total offset 5m > 0 '
        "and c unless sum without (z) (d)"
    ) == {"a_bucket", "b_total", "c", "d"}


async def test_every_dashboard_query_names_exported_metrics():
    start = time.monotonic()
    texts = await _scrape_after_traffic()
    elapsed = time.monotonic() - start
    scraped = set().union(*map(_sample_names, texts.values()))
    exported = scraped | vllm_connector_metrics()
    # The fake engines report checksum throughput as vLLM's connector does
    # (each has one worker: its seconds fit in the traffic's).
    for role in ("prefill", "decode"):
        assert metric(texts[role], "kvguard_kv_checksum_bytes_total") > 0
        assert 0 < metric(texts[role], "kvguard_kv_checksum_seconds_total") < elapsed
    queries = _queries()
    assert len(queries) >= 15
    missing = {
        (title, name)
        for title, expr in queries
        for name in metric_names(expr)
        if name not in exported
    }
    assert not missing, f"not exported by the proxy or engines: {sorted(missing)}"
    # Every query selects something.
    assert all(metric_names(expr) for _, expr in queries)


def test_the_dashboard_shows_what_operators_need():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    used = {
        t: set().union(*map(metric_names, [q["expr"] for q in p["targets"]]))
        for t, p in panels.items()
    }

    def panel_using(name: str) -> dict:
        titles = [t for t, names in used.items() if name in names]
        assert titles, f"no panel uses {name}"
        return panels[titles[0]]

    matrix = panel_using("kvguard_proxy_kv_integrity_failures_total")
    assert matrix["type"] == "table"
    (grouping,) = [
        t for t in matrix["transformations"] if t["id"] == "groupingToMatrix"
    ]
    assert grouping["options"]["rowField"] == "prefill"
    assert grouping["options"]["columnField"] == "decode"
    assert (
        "by (reason)"
        in panel_using("kvguard_proxy_retries_total")["targets"][0]["expr"]
    )
    without_kv = panel_using("kvguard_proxy_prefills_without_kv_params_total")
    assert "by (exported_instance)" in without_kv["targets"][0]["expr"]
    for histogram in (
        "kvguard_proxy_ttft_seconds_bucket",
        "kvguard_proxy_inter_token_seconds_bucket",
    ):
        exprs = [q["expr"] for q in panel_using(histogram)["targets"]]
        assert {
            re.search(r"histogram_quantile\(([\d.]+)", e).group(1) for e in exprs
        } == {"0.5", "0.9", "0.99"}
    panel_using("kvguard_proxy_ejections_total")
    panel_using("kvguard_proxy_instance_up")
    throughput = panel_using("kvguard_kv_checksum_seconds_total")
    assert "kvguard_kv_checksum_bytes_total" in throughput["targets"][0]["expr"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels.values():
        assert panel["datasource"]["uid"] == "${datasource}"
