"""``kvguard fake-engine``: its flags map onto the engine's settings, bad ones
are refused, and one engine runs as its own process until SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from fake_engine.cli import build_parser, config_from_args, main
from fake_engine.config import (
    EngineConfig,
    FaultKind,
    FaultSide,
    KVLoadFailurePolicy,
    Role,
)


def test_flags_map_onto_the_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "--role=producer",
            "--tp-size=2",
            "--block-size=32",
            "--kv-checksums=off",
            "--fail-open",
            "--kv-load-failure-policy=recompute",
            "--lease-s=5",
            "--fault=stale",
            "--fault-side=consumer",
            "--fault-rate=0.25",
            "--fault-count=3",
            "--enable-fault-admin",
            "--prefill-tokens-per-s=5000",
            "--decode-tokens-per-s=40",
        ]
    )
    config = config_from_args(args)
    assert config.role is Role.PRODUCER
    assert (config.tp_size, config.block_size) == (2, 32)
    assert not config.kv_checksums and not config.fail_closed
    assert config.kv_load_failure_policy is KVLoadFailurePolicy.RECOMPUTE
    assert config.lease_s == 5
    assert (
        config.fault.fault is FaultKind.STALE
        and config.fault.side is FaultSide.CONSUMER
    )
    assert (config.fault.rate, config.fault.count) == (0.25, 3)
    assert config.enable_fault_admin
    assert (config.prefill_tokens_per_s, config.decode_tokens_per_s) == (5000, 40)


@pytest.mark.parametrize(
    ("argv", "fail_closed"),
    [([], True), (["--fail-closed"], True), (["--fail-open"], False)],
    ids=["default", "--fail-closed", "--fail-open"],
)
def test_fail_closed_is_the_default_and_fail_open_an_explicit_opt_in(
    argv: list[str], fail_closed: bool
) -> None:
    config = config_from_args(build_parser().parse_args(argv))
    assert config.fail_closed is fail_closed
    assert EngineConfig().fail_closed


@pytest.mark.parametrize(
    "argv",
    [
        ["--fault=meltdown"],
        ["--kv-checksums=maybe"],
        ["--tp-size=3"],
        ["--fault-rate=2"],
        ["--torch-threads=0"],
    ],
)
def test_bad_flags_exit_with_usage(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_engine_process_serves_until_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvguard.cli", "fake-engine", "--port=0", "--layers=2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        port = None
        for line in process.stderr:
            if match := re.search(r"on http://127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port is not None
        body = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
