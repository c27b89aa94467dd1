"""Property tests of KVGuard's part of ``--kv-transfer-config``: any JSON
value as ``kv_connector_extra_config`` is refused with a
``KVGuardConfigError`` that says what is wrong, or gives settings that hold
together and build the inner connector's ``KVTransferConfig`` (or refuse it
with the same error). Importing ``engine_patch.vllm`` needs vLLM."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from vllm.config import KVTransferConfig

from engine_patch.vllm.config import (
    KVGUARD_CONNECTORS,
    KVGuardConfigError,
    KVGuardSettings,
    inner_transfer_config,
    parse_settings,
)

pytestmark = pytest.mark.vllm

# Each example validates one small model and may build a KVTransferConfig
# (well under a millisecond): 200 keep the file within a second or two.
FAST = settings(max_examples=200, deadline=None)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["on", "off", "true", "0", "1", "all", "first", "mamba"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)

# Near misses: the known keys, with values of every kind.
checksums = st.fixed_dictionaries(
    {},
    optional={
        "enabled": json_values,
        "fail_closed": json_values,
        "compile": json_values,
        "fail_closd": json_values,
    },
)
faults = st.fixed_dictionaries(
    {},
    optional={
        "loads": st.sampled_from(["all", "every_other", "first", "some"]) | json_values,
        "count": st.integers(-(2**70), 2**70) | json_values,
        "layers": st.sampled_from(["any", "full_attention", "sliding_window", "mamba"])
        | json_values,
    },
)
inner_names = st.sampled_from(
    ["NixlConnector", "ExampleConnector", "", "Nope", *sorted(KVGUARD_CONNECTORS)]
)
inners = st.fixed_dictionaries(
    {},
    optional={
        "kv_connector": inner_names | json_values,
        "kv_role": st.sampled_from(["kv_producer", "kv_consumer", "kv_both", "x"]),
        "kv_load_failure_policy": st.sampled_from(["fail", "recompute", "x"]),
        "kv_port": st.integers(-1, 70000) | json_values,
        "kv_buffer_device": st.sampled_from(["cpu", "cuda", ""]),
        "engine_id": json_values,
        "port": json_values,
    },
)
near_misses = st.fixed_dictionaries(
    {},
    optional={
        "inner": inners | json_values,
        "kv_checksums": checksums | json_values,
        "fault_injection": faults | json_values,
        "checksums": json_values,
    },
)


def outer(extra: Any) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_connector_module_path="engine_patch.vllm",
        kv_role="kv_consumer",
        kv_load_failure_policy="fail",
        kv_connector_extra_config=extra or {},  # None: as parse_settings reads it
    )


def check(extra: Any, fault_injection: bool) -> None:
    """``extra`` is refused clearly, or its settings hold together."""
    before = copy.deepcopy(extra)
    transfer = SimpleNamespace(kv_connector_extra_config=extra)
    try:
        found = parse_settings(transfer, fault_injection=fault_injection)  # type: ignore[arg-type]
    except KVGuardConfigError as exc:
        message = str(exc)
        assert message.startswith("Invalid KVGuard config in --kv-transfer-config: ")
        assert len(message) > 50
        return
    finally:
        assert extra == before or extra != extra  # nothing it was given changed
    assert isinstance(found, KVGuardSettings)
    name = found.inner["kv_connector"]
    assert isinstance(name, str) and name and name not in KVGUARD_CONNECTORS
    assert (found.fault_injection is not None) == fault_injection
    if found.fault_injection is not None:
        assert found.kv_checksums.enabled
        assert isinstance(found.fault_injection.corrupts(1), bool)
    parallel = SimpleNamespace(
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
    )
    config = found.checksum_config(SimpleNamespace(parallel_config=parallel))  # type: ignore[arg-type]
    assert config.enabled is found.kv_checksums.enabled
    assert config.fail_closed is found.kv_checksums.fail_closed
    try:
        inner = inner_transfer_config(outer(extra), found)
    except KVGuardConfigError as exc:
        assert str(exc).startswith("Invalid KVGuard config in --kv-transfer-config")
        return
    assert inner.kv_connector == name
    assert inner.kv_role == "kv_consumer"


@FAST
@given(json_values, st.booleans())
def test_any_json_value_is_a_config_error_or_settings_that_hold(
    extra: Any, fault_injection: bool
) -> None:
    check(extra, fault_injection)


@FAST
@given(near_misses, st.booleans())
# Near misses random search rarely combines with an otherwise valid config.
@example({"inner": {"kv_connector": ""}}, False)
@example({"fault_injection": {}, "kv_checksums": {"enabled": False}}, True)
def test_a_near_miss_is_a_config_error_or_settings_that_hold(
    extra: dict[str, Any], fault_injection: bool
) -> None:
    check(extra, fault_injection)
