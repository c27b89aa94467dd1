"""Property tests of the proxy's configuration entry points: YAML text and
files (``parse_config``, ``load_config``) and the command line
(``proxy.cli``). Arbitrary or near-valid input is either refused with a
``ConfigError`` that says where and why, or gives a configuration the proxy
can use: finite durations, the same configuration when validated again (as
``with_overrides`` and reloads do), a ``ProxyState`` built from it, and a
resolver for its nameservers."""

from __future__ import annotations

import asyncio
import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from proxy.cli import build_parser, config_from_args
from proxy.config import (
    ConfigError,
    ProxyConfig,
    load_config,
    parse_config,
    with_overrides,
)
from proxy.discovery import make_resolver, split_dns_name
from proxy.state import ProxyState

# A hundred examples per property: each builds a ProxyState in its own
# event loop (a few ms), and the file must stay within seconds on a loaded
# 2-core machine.
FAST = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

VALID: dict[str, Any] = {
    "server": {"host": "127.0.0.1", "port": 8000},
    "models": {
        "m": {
            "prefill": {
                "policy": "prefix_hash",
                "instances": [
                    {"url": "http://10.0.0.1:8100", "weight": 2},
                    {"dns": "prefill.kv.svc:8100"},
                ],
            },
            "decode": {"instances": [{"url": "http://[::1]:8200/"}]},
        },
        "*": {
            "prefill": {"instances": [{"url": "https://p.example:443"}]},
            "decode": {
                "policy": "least_inflight",
                "instances": [{"url": "http://d:8200", "weight": 0.5}],
            },
        },
    },
    "retry": {
        "max_attempts": 3,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.25,
        "non_stream_as_stream": True,
        "non_stream_interval": 16,
        "on_exhausted": "fail",
    },
    "timeouts": {
        "connect_s": 3.0,
        "prefill_s": 60.0,
        "decode_first_token_s": 60.0,
        "stream_idle_s": 30.0,
        "total_s": 600.0,
        "backend_keepalive_s": 4.0,
        "request_body_s": 30.0,
    },
    "health": {
        "enabled": True,
        "path": "/health",
        "interval_s": 5.0,
        "timeout_s": 2.0,
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
    },
    "discovery": {
        "interval_s": 10.0,
        "timeout_s": 2.0,
        "nameservers": ["10.96.0.10", "127.0.0.1:5353", "[::1]:53"],
    },
    "ejection": {
        "enabled": True,
        "window_s": 60.0,
        "instance_failures": 3,
        "pair_failures": 5,
        "cooldown_s": 30.0,
    },
    "limits": {"max_in_flight": 4096, "max_body_bytes": 1 << 20},
    "auth": {},
    "routing": {"prefix_hash_bytes": 256},
    "logging": {"level": "info", "attempts": True},
}


def test_the_base_of_the_mutations_is_valid_and_usable() -> None:
    check_usable(parse_config(yaml.safe_dump(VALID)))


# ------------------------------------------------------------ strategies

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 1, 65535, 65536, 2**31, 2**63, -(2**64), 10**30]),
    st.floats(),  # NaN and the infinities included
    st.sampled_from([math.inf, -math.inf, math.nan, 1e308, 5e-324, -0.0]),
    st.text(max_size=20),
)
numbers = st.one_of(
    st.integers(-3, 100),
    st.floats(-1, 1e4),
    st.sampled_from([math.inf, -math.inf, math.nan, 1e308, 1e7, 2**63, 10**30]),
    st.just(math.inf),
)
yaml_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)

# Scalars as YAML text, some of which PyYAML's own constructors choke on.
RAW_SCALARS = [
    "2001-02-30",
    "2001-13-01",
    "2001-01-01",
    "!!bool x",
    "!!int abc",
    '!!int ""',
    "!!int 0x",
    '!!float "."',
    "!!timestamp x",
    "!!binary aGk=",
    '!!binary "!!"',
    "!!set {a: 1}",
    "!!omap [1]",
    "!!str [1]",
    "!!python/name:os.system x",
    ".inf",
    "-.inf",
    ".nan",
    "0x1F",
    "0o17",
    "1_000",
    "1:30",
    "~",
    "[]",
    "{}",
    "*undefined",
    "&a [*a]",
    '"\\0"',
    '"a\\u0000b"',
    "'",
    "- a",
    "[" * 600 + "]" * 600,  # deeper than PyYAML's recursion goes
    "{a: " * 600 + "1" + "}" * 600,
]

hosts = st.one_of(
    st.sampled_from(["10.0.0.5", "[::1]", "[:]", "[zz:zz]", "Bücher.Example"]),
    st.sampled_from(
        [
            "10.0.0.5",
            "[::1]",
            "[fe80::1%25eth0]",
            "[::1",
            "::1",
            "[:]",
            "[zz:zz]",
            "bücher.example",
            "xn--bcher-kva.example",
            "h h",
            "",
            "a" * 70 + ".example",
            "localhost.",
            "[v1.x]",
            "%00",
            "\x00",
        ]
    ),
    st.text(max_size=12),
)
ports = st.one_of(
    st.none(),
    st.integers(-2, 70000).map(str),
    st.sampled_from(["", "0", "65535", "65536", " 80", "8_0", "\u0665\u0663", "x"]),
)


@st.composite
def odd_urls(draw: st.DrawFn) -> str:
    """URLs near a backend's base URL: odd schemes, hosts, ports, paths."""
    # Mostly well formed but for one part: more of them load.
    scheme = draw(
        st.sampled_from(["http://"] * 4 + ["https://", "HTTP://", "ftp://", ""])
    )
    user = draw(st.sampled_from([""] * 8 + ["me@", "me:secret@", "@", ":@"]))
    port = draw(ports)
    path = draw(
        st.sampled_from(["", "/", "/v1", "/v1/", "/a/b/", "/%zz", "/x?q=1", "/#f"])
    )
    host = draw(hosts)
    return f"{scheme}{user}{host}{'' if port is None else ':' + port}{path}"


@st.composite
def odd_dns(draw: st.DrawFn) -> str:
    """``host:port`` entries and near misses."""
    host, port = draw(hosts), draw(ports)
    extra = draw(st.sampled_from(["", "/x", "http://", " "]))
    text = f"{host}{'' if port is None else ':' + port}"
    return extra + text if extra == "http://" else text + extra


nameservers = st.builds(
    lambda host, port: host if port is None else f"{host}:{port}",
    st.sampled_from(
        [
            *("10.96.0.10", "[10.96.0.10]", "[::1]", "[::1", "::1"),
            *("[fe80::1%eth0]", "fe80::1%eth0", "host", ""),
        ]
    )
    | st.ip_addresses().map(str),
    ports,
)
health_paths = st.sampled_from(
    ["/health", "health", "//evil/x", "/\\x", "/a b", "/%", "/?x", "/#", "http://e/"]
) | st.text(max_size=10)

# Values tailored to the field a path ends in.
BY_FIELD = {
    "url": odd_urls(),
    "dns": odd_dns(),
    "nameservers": nameservers,
    "path": health_paths,
    "host": hosts,
}


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``value`` (dict keys and list indexes)."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_of(item, (*prefix, index))
    return found


PATHS = paths_of(VALID)


def value_at(path: tuple[Any, ...]) -> Any:
    value: Any = VALID
    for part in path:
        value = value[part]
    return value


def field_of(path: tuple[Any, ...]) -> str:
    """The name of the field ``path`` is in (a list item's: its list's)."""
    return next((p for p in reversed(path) if isinstance(p, str)), "")


# The paths each kind of mutation applies to.
PATHS_FOR = {
    "field": [
        p for p in PATHS if field_of(p) in BY_FIELD and isinstance(value_at(p), str)
    ],
    "number": [
        p
        for p in PATHS
        if isinstance(value_at(p), int | float) and not isinstance(value_at(p), bool)
    ],
    "delete": [p for p in PATHS if isinstance(p[-1], str)],
    "unknown": [p for p in PATHS if isinstance(p[-1], str)],
    "twice": [p for p in PATHS if isinstance(p[-1], int)],
}
RAW = "__raw_yaml_scalar__"


WILD = ["value", "field", "number", "raw", "delete", "unknown", "twice", "empty"]
# Near misses, which often still load: the invariants get exercised.
NEAR = ["field", "field", "number", "number", "delete", "twice"]


@st.composite
def mutated_configs(draw: st.DrawFn, actions: list[str]) -> str:
    """The YAML text of ``VALID`` after one to three of ``actions``: a value
    replaced (by anything, by a near miss for its field, by another number,
    by raw YAML), a key deleted or unknown, a list item duplicated, or a
    section emptied."""
    data = copy.deepcopy(VALID)
    raw: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(actions))
        path = draw(st.sampled_from(PATHS_FOR.get(action, PATHS)))
        parent: Any = data
        try:
            for part in path[:-1]:
                parent = parent[part]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed it
        if not isinstance(parent, dict | list):
            continue  # or replaced its parent
        key = path[-1]
        if action == "field":
            parent[key] = draw(BY_FIELD[field_of(path)])
        elif action == "number":
            parent[key] = draw(numbers)
        elif action == "raw" and not raw:
            raw.append(draw(st.sampled_from(RAW_SCALARS)))
            parent[key] = RAW
        elif action == "delete":
            del parent[key]
        elif action == "unknown":
            parent[draw(st.text(min_size=1, max_size=8))] = draw(yaml_values)
        elif action == "twice":
            parent.append(copy.deepcopy(parent[key]))
        elif action == "empty":
            parent[key] = draw(st.sampled_from([None, {}, []]))
        else:
            parent[key] = draw(yaml_values)
    text = yaml.safe_dump(data, allow_unicode=draw(st.booleans()))
    return text.replace(RAW, raw[0]) if raw else text


# ------------------------------------------------------------ the property


def floats_in(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for item in value.values() for f in floats_in(item)]
    if isinstance(value, list | tuple):
        return [f for item in value for f in floats_in(item)]
    return []


def check_usable(config: ProxyConfig) -> None:
    """What the proxy does with a configuration at start, reload and run,
    short of the network."""
    # aiohttp rounds its timers' deadlines with math.ceil: no infinity.
    assert all(math.isfinite(f) for f in floats_in(config.model_dump()))
    # with_overrides and reloads validate sections again from their dump.
    assert ProxyConfig.model_validate(config.model_dump()) == config
    assert with_overrides(config, {"server": {}, "logging": {}}) == config
    for model in config.models.values():
        for pool in (model.prefill, model.decode):
            assert pool.instances
            keys = [entry.key for entry in pool.instances]
            assert len(keys) == len(set(keys))
            for entry in pool.instances:
                if entry.url is not None:
                    url = URL(entry.url)
                    assert url.scheme in ("http", "https") and url.host
                    # The health prober's URL keeps the instance's host.
                    probe = URL(entry.url + config.health.path)
                    assert probe.origin() == url.origin()
                else:
                    assert entry.dns is not None
                    host, port = split_dns_name(entry.dns)
                    assert host and 0 <= port <= 65535

    async def build() -> None:
        try:
            state = ProxyState(config)
        except ConfigError as exc:  # a key it names cannot be read
            assert str(exc)
            return
        assert set(state.models) == set(config.models)
        if config.discovery.nameservers is not None:
            resolver = make_resolver(config.discovery)
            await resolver.close()

    asyncio.run(build())


def check_outcome(load: Any, source: str) -> None:
    """``load()`` refuses with a ConfigError naming ``source``, or the
    configuration it returns is usable."""
    try:
        config = load()
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith(source), message
        assert len(message) > len(source) + 2, message
        return
    check_usable(config)


# ------------------------------------------------------------ YAML


@FAST
@given(yaml_values)
def test_any_yaml_value_is_a_config_error_or_a_usable_config(value: Any) -> None:
    text = yaml.safe_dump(value)
    check_outcome(lambda: parse_config(text, "x.yaml"), "x.yaml")


@FAST
@given(st.text(max_size=200))
def test_any_text_is_a_config_error_or_a_usable_config(text: str) -> None:
    check_outcome(lambda: parse_config(text, "x.yaml"), "x.yaml")


@FAST
@given(mutated_configs(WILD))
def test_a_mutated_valid_config_is_a_config_error_or_a_usable_config(
    text: str,
) -> None:
    check_outcome(lambda: parse_config(text, "x.yaml"), "x.yaml")


@FAST
@given(mutated_configs(NEAR))
def test_a_near_miss_of_a_valid_config_is_a_config_error_or_a_usable_config(
    text: str,
) -> None:
    check_outcome(lambda: parse_config(text, "x.yaml"), "x.yaml")


@FAST
@given(
    st.one_of(
        odd_urls().map(lambda v: ("url", v)),
        # Only the host odd: the URL's other parts do not refuse it first.
        st.builds("http://{}:{}".format, hosts, st.integers(1, 65535)).map(
            lambda v: ("url", v)
        ),
        odd_dns().map(lambda v: ("dns", v)),
        nameservers.map(lambda v: ("nameserver", v)),
    )
)
def test_an_odd_url_dns_name_or_nameserver_is_a_config_error_or_usable(
    odd: tuple[str, str],
) -> None:
    kind, value = odd
    data: dict[str, Any] = {
        "models": {
            "m": {
                "prefill": {"instances": [{"url": "http://p:8100"}]},
                "decode": {"instances": [{"dns": "d.kv:8200"}]},
            }
        }
    }
    if kind == "nameserver":
        data["discovery"] = {"nameservers": [value]}
    else:
        pool = data["models"]["m"]["prefill" if kind == "url" else "decode"]
        pool["instances"] = [{kind: value}]
    text = yaml.safe_dump(data)
    check_outcome(lambda: parse_config(text, "x.yaml"), "x.yaml")


@settings(FAST, max_examples=25)  # a deep document takes ~0.1 s to refuse
@given(
    depth=st.integers(0, 1500),
    opener=st.sampled_from(["[", "{a: ", "- "]),
    path=st.sampled_from(PATHS),
)
def test_yaml_nested_to_any_depth_is_a_config_error_or_a_usable_config(
    depth: int, opener: str, path: tuple[Any, ...]
) -> None:
    data = copy.deepcopy(VALID)
    parent: Any = data
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = RAW
    if opener == "- ":
        nested = "".join(f"\n{'  ' * i}- " for i in range(depth)) + "1"
    else:
        nested = opener * depth + "1" * (opener != "[") + "]}"[opener != "["] * depth
    text = yaml.safe_dump(data).replace(RAW, nested)
    check_outcome(lambda: parse_config(text, "x.yaml"), "x.yaml")


@FAST
@given(
    prefix=st.binary(max_size=8),
    body=st.sampled_from([b"", yaml.safe_dump(VALID).encode()]),
    suffix=st.binary(max_size=8),
)
def test_any_file_bytes_are_a_config_error_or_a_usable_config(
    tmp_path: Path, prefix: bytes, body: bytes, suffix: bytes
) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_bytes(prefix + body + suffix)
    check_outcome(lambda: load_config(path), str(path))


# ------------------------------------------------------------ examples


@pytest.mark.parametrize(
    ("text", "why"),
    [
        # PyYAML's constructors raised ValueError, KeyError, AttributeError.
        ("server:\n  host: 2001-02-30\n", "line 2"),
        ("server: {port: !!int abc}\n", "cannot read 'abc' as a int"),
        ("logging: {attempts: !!bool x}\n", "cannot read 'x' as a bool"),
        ("logging: {attempts: !!timestamp x}\n", "as a timestamp"),
        # RecursionError while composing.
        ("models: " + "[" * 1000 + "]" * 1000, "nested too deeply"),
    ],
)
def test_yaml_its_parser_cannot_construct_is_a_config_error(
    text: str, why: str
) -> None:
    with pytest.raises(ConfigError, match=r"^x\.yaml: invalid YAML") as info:
        parse_config(text, "x.yaml")
    assert why in str(info.value)


MODELS = """\
models:
  m:
    prefill: {instances: [{url: "http://p:8100"}]}
    decode: {instances: [{url: "http://d:8200"}]}
"""


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("health", "timeout_s"),  # the proxy's start raised OverflowError
        ("timeouts", "backend_keepalive_s"),  # every pooled connection did
        ("timeouts", "total_s"),
        ("ejection", "cooldown_s"),
    ],
)
def test_an_infinite_duration_is_a_config_error(section: str, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{section}\.{field}: .*finite"):
        parse_config(MODELS + f"{section}:\n  {field}: .inf\n", "x.yaml")


def test_a_model_name_json_wrote_as_a_surrogate_pair_is_the_character() -> None:
    # json.dumps (ensure_ascii) writes an emoji as two \\u escapes, which
    # PyYAML kept as two lone surrogates: /metrics, /status and /v1/models
    # then answered 500, unable to encode the name.
    text = json.dumps(
        {
            "models": {
                "m\U0001f600": {
                    "prefill": {"instances": [{"url": "http://p:8100"}]},
                    "decode": {"instances": [{"url": "http://d:8200"}]},
                }
            }
        }
    )
    assert "\\ud83d\\ude00" in text
    assert list(parse_config(text, "x.json").models) == ["m\U0001f600"]


def test_a_lone_surrogate_anywhere_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="lone UTF-16 surrogate"):
        parse_config(MODELS.replace("  m:", '  "m\\ud800":'), "x.yaml")
    with pytest.raises(ConfigError, match="lone UTF-16 surrogate"):
        parse_config(MODELS + 'server:\n  host: "h\\udfff"\n', "x.yaml")


@pytest.mark.parametrize("host", ["a b", "x\u2003y", "\u00b4", "a%20b"])
@pytest.mark.parametrize("field", ["url", "dns"])
def test_a_host_with_a_space_or_one_in_its_normal_form_is_a_config_error(
    host: str, field: str
) -> None:
    # yarl took them; "\u00b4" (an acute accent) became " \u0301", which
    # the next reload read back without its space: another instance.
    value = f"http://{host}:8100" if field == "url" else f"{host}:8100"
    text = MODELS.replace('{url: "http://p:8100"}', f"{{{field}: {json.dumps(value)}}}")
    with pytest.raises(ConfigError, match="not a valid host name"):
        parse_config(text, "x.yaml")


@pytest.mark.parametrize("alias", ["&a [*a]", "&a {k: *a}", "&a [1, {k: [*a]}]"])
def test_a_yaml_alias_nested_in_itself_is_a_config_error(alias: str) -> None:
    # Joining surrogate pairs walked the cycle until RecursionError.
    with pytest.raises(ConfigError, match=r"models\.m\.x: unknown field"):
        parse_config(MODELS + f"    x: {alias}\n", "x.yaml")


def test_nesting_yaml_composes_is_validated_without_overflowing_the_stack() -> None:
    # Joining surrogate pairs recursed, and overflowed on ~400 levels that
    # PyYAML had composed.
    for depth in range(300, 620, 20):
        with pytest.raises(ConfigError, match=r"unknown field|nested too deeply"):
            parse_config(MODELS + "    x: " + "[" * depth + "]" * depth, "x.yaml")


@pytest.mark.parametrize(
    "nameserver",
    [
        # int() and ip_address() took them; c-ares refused them (AresError,
        # UnicodeEncodeError) when discovery made its resolver.
        *("1.2.3.4: 53", "1.2.3.4:5_3", "1.2.3.4:\u0665\u0663", "[fe80::1%eth0]:53"),
        # c-ares: "Misformatted string".
        "[::1",
        *("10.0.0.1:0", "10.0.0.1:65536", "[::1]:0", "[::1]:65536", "[::1]x", "[::1]:"),
    ],
)
def test_a_nameserver_c_ares_cannot_use_is_a_config_error(nameserver: str) -> None:
    text = MODELS + f"discovery:\n  nameservers: [{nameserver!r}]\n"
    with pytest.raises(ConfigError, match=r"discovery\.nameservers: .*IP:PORT"):
        parse_config(text, "x.yaml")


@pytest.mark.parametrize(
    "nameserver", ["[::1]", "[::1]:1", "10.0.0.1:1", "10.0.0.1:65535", "[::1]:65535"]
)
def test_a_nameserver_with_a_port_from_1_to_65535_or_none_is_taken(
    nameserver: str,
) -> None:
    text = MODELS + f"discovery:\n  nameservers: [{nameserver!r}]\n"
    assert parse_config(text, "x.yaml").discovery.nameservers == [nameserver]


def test_a_nul_in_server_host_or_a_key_file_is_a_config_error(tmp_path: Path) -> None:
    # Binding raised ValueError, which the command line does not catch.
    with pytest.raises(ConfigError, match=r"server\.host: .*not a host"):
        parse_config(MODELS + 'server:\n  host: "a\\0b"\n', "x.yaml")
    # Reading the key file raised ValueError (embedded null byte).
    config = parse_config(MODELS + 'auth:\n  api_keys_file: "k\\0"\n', "x.yaml")
    with pytest.raises(ConfigError, match=r"auth\.api_keys: cannot read"):
        ProxyState(config)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "a\0b.yaml"))


# ------------------------------------------------------------ command line

flag_values = st.one_of(
    st.text(max_size=12),
    st.integers(-(2**40), 2**40).map(str),
    odd_urls(),
    st.sampled_from(["--", "-", "nan", "inf", "1e9", "info", "debug", "*"]),
)
flags = st.sampled_from(
    [
        "--host",
        "--port",
        "--log-level",
        "--prefill",
        "--decode",
        "--model",
        "--prefiller-hosts",
        "--prefiller-ports",
        "--decoder-hosts",
        "--decoder-ports",
    ]
)


@FAST
@given(
    st.lists(
        st.tuples(flags, st.lists(flag_values, min_size=1, max_size=3)), max_size=6
    )
)
def test_any_command_line_is_a_usage_error_a_config_error_or_a_usable_config(
    pairs: list[tuple[str, list[str]]],
) -> None:
    argv = ["--prefill", "http://p:8100", "--decode", "http://d:8200"]
    for flag, values in pairs:
        argv += [flag, *values]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's usage error
        assert exc.code == 2
        return
    check_outcome(lambda: config_from_args(args)[0], "")
