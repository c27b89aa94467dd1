"""deploy/prometheus: the alerting rules pass ``promtool check rules`` and their
unit tests, and a real Prometheus scraping the proxy and fake engines fires
the integrity alerts, the proxy's and the decode's own, while a faulty
prefill corrupts KV loads."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from ops_helpers import complete, eventually, need

from proxy.testing import running_proxy
from tests.support.ports import free_port
from tests.support.programs import ALERT_RULE_TESTS, ALERT_RULES, promtool


def test_rules_pass_promtool_check():
    assert "SUCCESS: 11 rules found" in promtool("check", "rules", str(ALERT_RULES))


def test_rules_pass_their_promtool_unit_tests():
    assert "SUCCESS" in promtool("test", "rules", str(ALERT_RULE_TESTS))


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load(ALERT_RULES.read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load(ALERT_RULE_TESTS.read_text())
    firing = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == firing
    assert {
        "KVGuardKVIntegrityFailure",
        "KVGuardUnverifiedKVLoads",
        "KVGuardInstanceEjected",
        "KVGuardPairEjected",
        "KVGuardHighRetryRate",
        "KVGuardNoUsablePrefillDecodePair",
        "KVGuardDecodeTTFTHigh",
        "KVGuardPrefillWithoutKVParams",
        "KVGuardConsumerWithoutKVGuard",
        "KVGuardKVChecksumMismatch",
    } <= alerts


class _Prometheus:
    """A real Prometheus on a free port with a temporary data directory."""

    def __init__(self, targets: dict[str, list[str]]) -> None:
        self.binary = need("prometheus", "prometheus")
        self.dir = Path(tempfile.mkdtemp(prefix="kvguard-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERT_RULES)],
            "scrape_configs": [
                {
                    "job_name": job,
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "static_configs": [{"targets": hosts}],
                }
                for job, hosts in targets.items()
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def _api(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        body = await resp.json()
        assert body["status"] == "success", body
        return body["data"]


# What a faulty prefill behind the proxy fires: the proxy's pair alert and
# ejection, and the decode's own count of mismatching loads.
EXPECTED_FIRING = (
    "KVGuardKVIntegrityFailure",
    "KVGuardInstanceEjected",
    "KVGuardKVChecksumMismatch",
)


async def test_integrity_alert_fires_in_a_real_prometheus(capsys):
    pytest.importorskip("torch")
    from fake_engine.config import FaultConfig, FaultKind, FaultSide, Role
    from fake_engine.testing import EngineSpec, fake_engines

    corrupting = FaultConfig(fault=FaultKind.BITFLIP, side=FaultSide.PRODUCER)
    specs = (
        EngineSpec(role=Role.PRODUCER),
        EngineSpec(role=Role.PRODUCER, fault=corrupting),
        EngineSpec(role=Role.CONSUMER, fail_closed=True),
    )
    async with fake_engines(*specs) as (good, bad, decode):
        config = {
            "models": {
                "*": {
                    "prefill": {"instances": [{"url": good}, {"url": bad}]},
                    "decode": {"instances": [{"url": decode}]},
                }
            },
            "retry": {"backoff_base_s": 0.002},
            "ejection": {"instance_failures": 3, "cooldown_s": 600},
        }
        async with (
            running_proxy(config) as proxy,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
        ):
            prom = _Prometheus(
                {
                    "kvguard-proxy": [proxy.url.removeprefix("http://")],
                    "kvguard-engines": [
                        u.removeprefix("http://") for u in (good, bad, decode)
                    ],
                }
            )
            try:

                async def all_up() -> bool:
                    try:
                        data = await _api(http, prom.url + "/api/v1/query?query=up")
                    except aiohttp.ClientError:
                        return False
                    return len(data["result"]) == 4 and all(
                        r["value"][1] == "1" for r in data["result"]
                    )

                await eventually(all_up, "Prometheus scraping all 4 targets", 60)
                answers = await asyncio.gather(
                    *(
                        complete(http, proxy.url, f"question {i} about KV", i % 2 == 0)
                        for i in range(12)
                    )
                )
                assert all(
                    status == 200 and text is not None for status, text in answers
                )

                firing: list[dict[str, Any]] = []

                async def alert_fires() -> bool:
                    data = await _api(http, prom.url + "/api/v1/alerts")
                    firing[:] = [
                        a
                        for a in data["alerts"]
                        if a["state"] == "firing"
                        and a["labels"]["alertname"] in EXPECTED_FIRING
                    ]
                    return {a["labels"]["alertname"] for a in firing} == set(
                        EXPECTED_FIRING
                    )

                await eventually(alert_fires, "the integrity alert firing", 60, 0.25)
            finally:
                prom.stop()
    integrity = next(
        a for a in firing if a["labels"]["alertname"] == "KVGuardKVIntegrityFailure"
    )
    assert integrity["labels"]["prefill"] == bad
    assert integrity["labels"]["decode"] == decode
    assert integrity["labels"]["severity"] == "critical"
    assert float(integrity["value"]) >= 1
    ejected = next(
        a for a in firing if a["labels"]["alertname"] == "KVGuardInstanceEjected"
    )
    assert ejected["labels"]["exported_instance"] == bad
    mismatch = next(
        a for a in firing if a["labels"]["alertname"] == "KVGuardKVChecksumMismatch"
    )
    # The engines' own count: the decode that loaded the corrupted KV.
    assert mismatch["labels"]["instance"] == decode.removeprefix("http://")
    assert mismatch["labels"]["severity"] == "critical"
    with capsys.disabled():
        print("\nPrometheus /api/v1/alerts (firing):")
        print(json.dumps(firing, indent=1))
