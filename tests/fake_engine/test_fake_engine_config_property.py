"""Property tests of the fake engine's settings: any command line is a
usage error (exit status 2, with a message) or an ``EngineConfig`` the
engine can use; ``EngineConfig`` and ``FaultConfig`` themselves refuse bad
values with a ``ValueError`` that names the setting."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fake_engine import cli
from fake_engine.config import DTYPES, EngineConfig, FaultConfig, FaultKind

# Parsing flags and building a frozen dataclass take microseconds; a few
# hundred examples stay well under a second each.
FAST = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

INT_FLAGS = [
    "--port",
    "--layers",
    "--kv-heads",
    "--head-size",
    "--tp-size",
    "--block-size",
    "--num-blocks",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--fault-count",
    "--fault-seed",
    "--torch-threads",
]
FLOAT_FLAGS = [
    "--lease-s",
    "--fault-rate",
    "--fault-delay-s",
    "--prefill-tokens-per-s",
    "--decode-tokens-per-s",
]
CHOICE_FLAGS = {
    "--role": ["producer", "consumer", "both", "decoder"],
    "--dtype": [*DTYPES, "int8"],
    "--kv-checksums": ["on", "off", "maybe"],
    "--kv-load-failure-policy": ["fail", "recompute", "retry"],
    "--fault": [*FaultKind, "meltdown"],
    "--fault-side": ["producer", "consumer", "both"],
}
numbers = st.one_of(
    st.integers(-3, 70000).map(str),
    st.sampled_from(["0", "-1", "2147483648", str(2**64), "1e400", "x", ""]),
    st.sampled_from(["nan", "inf", "-inf", "0.5", "1.5", "-0.0", "1e-300"]),
    st.floats().map(repr),
)
flag_pairs = st.one_of(
    st.tuples(st.sampled_from(INT_FLAGS + FLOAT_FLAGS), numbers),
    st.sampled_from(sorted(CHOICE_FLAGS)).flatmap(
        lambda flag: st.tuples(st.just(flag), st.sampled_from(CHOICE_FLAGS[flag]))
    ),
)


def check_usable(config: EngineConfig) -> None:
    """What the engine reads from a configuration, short of allocating it."""
    assert config.layers >= 1 and config.block_size >= 1
    assert config.torch_dtype in DTYPES.values()
    assert config.head_size * config.element_size % 8 == 0
    assert (
        config.heads_per_rank
        * config.head_replicas
        * min(config.tp_size, config.kv_heads)
        >= config.kv_heads
    )
    assert (config.num_blocks - 1) * config.block_size >= config.max_model_len
    assert config.max_blocks_per_request <= config.num_blocks - 1
    assert config.lease_s > 0 and not math.isnan(config.lease_s)
    fault = config.fault
    assert 0 <= fault.rate <= 1 and fault.delay_s >= 0
    assert fault.count is None or fault.count >= 0
    for speed in (config.prefill_tokens_per_s, config.decode_tokens_per_s):
        assert speed is None or speed > 0


@FAST
@given(pairs=st.lists(flag_pairs, max_size=5))
# Out of range alone (random flags mostly fail on another first).
@example(pairs=[("--port", "70000")])
@example(pairs=[("--fault-rate", "nan")])
@example(pairs=[("--lease-s", "-0.0")])
def test_any_command_line_is_a_usage_error_or_a_usable_config(
    pairs: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[tuple[EngineConfig, int]] = []

    async def serve(config: EngineConfig, host: str, port: int, *_: Any) -> None:
        served.append((config, port))

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    argv = [f"{flag}={value}" for flag, value in pairs]
    try:
        assert cli.main(argv) == 0
    except SystemExit as exc:  # argparse's usage error, after its message
        assert exc.code == 2
        return
    ((config, port),) = served
    assert 0 <= port <= 65535
    check_usable(config)


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["rate", "count", "delay_s"]),
        st.one_of(st.integers(-5, 5), st.floats(), st.none()),
    )
)
def test_a_fault_is_a_value_error_naming_the_setting_or_usable(
    values: dict[str, Any],
) -> None:
    if values.get("rate") is None:
        values.pop("rate", None)
    if values.get("delay_s") is None:
        values.pop("delay_s", None)
    try:
        fault = FaultConfig(**values)
    except ValueError as exc:
        assert any(name.split("_")[0] in str(exc) for name in values)
        return
    assert 0 <= fault.rate <= 1 and fault.delay_s >= 0
    assert fault.count is None or fault.count >= 0


@pytest.mark.parametrize(
    "argv",
    # Binding raised OverflowError; torch.set_num_threads ValueError.
    [
        ["--port=70000"],
        ["--port=-1"],
        ["--torch-threads=2147483648"],
        ["--torch-threads=1000000"],
    ],
)
def test_a_port_or_thread_count_out_of_range_is_a_usage_error(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def serve(*_: Any) -> None:
        raise AssertionError("served")

    monkeypatch.setattr(cli, "serve", serve)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert argv[0].split("=")[0] in capsys.readouterr().err


@pytest.mark.parametrize("count", [math.nan, 1.5, -1, "3"])
def test_a_fault_count_that_is_no_whole_number_is_a_value_error(count: Any) -> None:
    # NaN passed ``count < 0`` and injected the fault without end.
    with pytest.raises(ValueError, match="fault count must be a whole number"):
        FaultConfig(count=count)


def test_a_fault_takes_the_ends_of_its_ranges() -> None:
    assert FaultConfig(rate=0.0, count=0, delay_s=0.0).delay_s == 0.0
    assert FaultConfig(rate=1.0).rate == 1.0
    with pytest.raises(ValueError, match="fault delay must be >= 0"):
        FaultConfig(delay_s=-0.001)


def test_the_kv_pool_holds_max_model_len_besides_the_null_block() -> None:
    assert EngineConfig(num_blocks=9, block_size=16, max_model_len=128).num_blocks == 9
    with pytest.raises(ValueError, match="9 blocks of 16 tokens cannot hold"):
        EngineConfig(num_blocks=9, block_size=16, max_model_len=129)


def test_the_highest_port_and_thread_count_are_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served: list[int] = []
    threads: list[int] = []

    async def serve(config: EngineConfig, host: str, port: int, *_: Any) -> None:
        served.append(port)

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    top = f"--torch-threads={cli.MAX_TORCH_THREADS}"
    assert cli.main(["--port=65535", top]) == 0
    assert (served, threads) == ([65535], [cli.MAX_TORCH_THREADS])
