"""The proxy's YAML configuration, validated by pydantic.

Errors name the file, the field (with its line where the YAML has one) and
why, so a typo in a deployment fails at start or reload with a usable message
instead of a half-configured proxy.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from yarl import URL

Role = Literal["prefill", "decode"]
PolicyName = Literal["round_robin", "least_inflight", "power_of_two", "prefix_hash"]

# The model key that serves any model name not configured explicitly.
ANY_MODEL = "*"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and why."""


class _Strict(BaseModel):
    # Not infinity or NaN: every float but a weight (bounded) is a duration,
    # and aiohttp rounds its timers' deadlines with math.ceil, which an
    # infinite one overflows (health.timeout_s: .inf stopped the start).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _whole_characters(cls, data: Any) -> Any:
        return _joined_surrogates(data)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _joined_surrogates(value: Any) -> Any:
    """``value`` with the UTF-16 surrogate pairs in its strings joined.

    YAML's and JSON's ``\\u`` escapes write a character outside the BMP as a
    pair, which PyYAML leaves split (a config written by ``json.dumps``
    names a model ``"m\\ud83d\\ude00"``); no UTF-8 answer can carry one.
    Containers are copied without recursion, once each: nesting as deep as
    PyYAML composes cannot overflow the stack, and a YAML alias nested in
    itself (``&a [*a]``) stays a cycle, which pydantic refuses.

    Raises:
        ValueError: A string holds a lone surrogate.
    """
    copies: dict[int, Any] = {}
    to_fill: list[Any] = []

    def copied(item: Any) -> Any:
        if isinstance(item, str):
            return _joined(item)
        if not isinstance(item, dict | list):
            return item
        copy = copies.get(id(item))
        if copy is None:
            copy = copies[id(item)] = [] if isinstance(item, list) else {}
            to_fill.append(item)
        return copy

    result = copied(value)
    while to_fill:
        item = to_fill.pop()
        copy = copies[id(item)]
        if isinstance(item, list):
            copy.extend(copied(v) for v in item)
        else:
            copy.update((copied(k), copied(v)) for k, v in item.items())
    return result


def _joined(text: str) -> str:
    """``text`` with its surrogate pairs joined.

    Raises:
        ValueError: ``text`` holds a lone surrogate.
    """
    if _SURROGATE.search(text) is None:
        return text
    try:
        return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise ValueError(f"{text!r} holds a lone UTF-16 surrogate: not text") from None


# What a resolver can look up, in the ASCII (IDNA) form: letters, digits,
# hyphens and dots, and the underscores some service names carry.
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _check_host(url: URL, value: str) -> None:
    """Checks the host of ``url`` (parsed from ``value``) is an IP address or
    a name a resolver can look up: yarl takes anything in brackets, a space,
    or a character whose compatibility form starts with one (an acute
    accent), and gives back a URL that does not parse or reads back
    differently.

    Raises:
        ValueError: a bracketed host that is no IPv6 address, or a host name
            with other characters, an empty or an over-long label.
    """
    host = url.host or ""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"not an IPv6 address in brackets: {value!r}") from None
        return
    try:
        ipaddress.IPv4Address(host)
        return
    except ValueError:
        pass
    try:
        host.encode("idna")
    except UnicodeError:
        raise ValueError(f"not a valid host name: {value!r}") from None
    if _HOST_NAME.fullmatch(url.raw_host or "") is None:
        raise ValueError(f"not a valid host name: {value!r}")


def normalize_url(value: str) -> str:
    """Returns a backend base URL without a trailing slash.

    Raises:
        ValueError: not an absolute http(s) URL with a host, or it carries a
            query, fragment or credentials, or ends in ``/v1``.
    """
    url = URL(value.strip())
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(
            f"must be an http:// or https:// URL with a host, got {value!r}"
        )
    _check_host(url, value)
    if url.query_string or url.fragment:
        raise ValueError(f"must not carry a query or fragment, got {value!r}")
    if url.user is not None or url.password is not None:
        # URLs are metric labels and log fields: keys go in api_key_env/_file.
        raise ValueError("must not carry credentials: give api_key_env or api_key_file")
    if url.path.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"is the server's base URL, without /v1 (the proxy adds the "
            f"OpenAI paths), got {value!r}"
        )
    # Parsed again: yarl lower-cases a host it IDNA-encodes only then, and a
    # reload of this URL must give this URL.
    return str(URL(str(url))).rstrip("/")


def normalize_dns_name(value: str) -> str:
    """Returns ``host:port`` for a DNS pool entry, the host lower-cased.

    Raises:
        ValueError: not a bare ``host:port`` (no scheme, path or user), or no port.
    """
    text = value.strip()
    url = URL(f"http://{text}") if "://" not in text else None
    if (
        url is None
        or not url.host
        or url.explicit_port is None
        or url.path not in ("", "/")
        or url.user
        or url.query_string
        or url.fragment
    ):
        raise ValueError(f"must be host:port, e.g. prefill.kv.svc:8100, got {value!r}")
    _check_host(url, value)
    host, port = url.host.lower(), url.explicit_port
    # An IPv6 literal keeps its brackets: the result reads back as it is.
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _nameserver(value: str) -> str:
    """Checks ``ip``, ``ip:port`` or ``[ipv6]:port``; returns it unchanged.

    Raises:
        ValueError: not an IP address with an optional port.
    """
    host, port = value, None
    try:
        if value.startswith("["):
            # c-ares refuses "[::1" as a misformatted string.
            host, bracket, rest = value[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError
            port = rest[1:] if rest else None
        elif value.count(":") == 1:
            host, port = value.split(":")
        address = ipaddress.ip_address(host)
        # c-ares refuses (or drops) what int() and ip_address() let through:
        # " 53", "5_3", non-ASCII digits, a scope id such as %eth0.
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
            raise ValueError
        if port is not None and not (
            port.isascii() and port.isdigit() and 0 < int(port) < 65536
        ):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"nameserver must be IP, IP:PORT or [IPv6]:PORT, got {value!r}"
        ) from None
    return value


# Routing adds weights up: power_of_two's weighted draw raises on an
# infinite total.
MAX_WEIGHT = 1e6


class InstanceConfig(_Strict):
    """One backend instance (``url``), or every address a DNS name has (``dns``)."""

    url: str | None = Field(
        default=None, description="Base URL, e.g. http://10.0.0.5:8100"
    )
    dns: str | None = Field(
        default=None,
        description="host:port, e.g. prefill.kv.svc.cluster.local:8100: every A/AAAA "
        "record is an instance http://ADDRESS:port, re-resolved every "
        "discovery.interval_s (a headless Kubernetes Service, Consul DNS, Compose)",
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=MAX_WEIGHT,
        allow_inf_nan=True,  # its bounds say what is wrong with .inf
        description="Relative share of traffic",
    )
    api_key_env: str | None = Field(
        default=None,
        description="Environment variable holding this instance's API key "
        "(overrides auth.backend_api_key_*)",
    )
    api_key_file: str | None = Field(
        default=None, description="File holding this instance's API key"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else normalize_url(value)

    @field_validator("dns")
    @classmethod
    def _dns(cls, value: str | None) -> str | None:
        return None if value is None else normalize_dns_name(value)

    @model_validator(mode="after")
    def _one_source(self) -> InstanceConfig:
        if (self.url is None) == (self.dns is None):
            raise ValueError("give exactly one of url or dns")
        return self

    @property
    def key(self) -> str:
        """What identifies the entry in its pool: its URL or ``dns:host:port``."""
        return self.url if self.url is not None else f"dns:{self.dns}"


class PoolConfig(_Strict):
    """The instances of one role for one model and how to pick among them."""

    policy: PolicyName = "round_robin"
    instances: list[InstanceConfig] = Field(min_length=1)

    @field_validator("instances")
    @classmethod
    def _unique(cls, value: list[InstanceConfig]) -> list[InstanceConfig]:
        seen: set[str] = set()
        for inst in value:
            if inst.key in seen:
                raise ValueError(f"instance {inst.key} is listed twice")
            seen.add(inst.key)
        return value


class ModelConfig(_Strict):
    """Prefill and decode pools serving one model name."""

    prefill: PoolConfig
    decode: PoolConfig


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        # The socket calls raise ValueError, not OSError, on a NUL.
        if "\x00" in value:
            raise ValueError(f"not a host name or address: {value!r}")
        return value


class RetryConfig(_Strict):
    """Retries of failures before the client's first byte."""

    max_attempts: int = Field(
        default=3, ge=1, le=20, description="Prefill+decode attempts per request"
    )
    backoff_base_s: float = Field(default=0.01, ge=0)
    backoff_max_s: float = Field(default=0.25, ge=0)
    non_stream_as_stream: bool = Field(
        default=True,
        description="Decode non-streaming requests as a stream, assembled into "
        "one reply, so that decode_first_token_s and stream_idle_s bound a hung "
        "KV load and it is retried; false: one reply bounded only by total_s",
    )
    non_stream_interval: int = Field(
        default=16,
        ge=1,
        le=4096,
        description="Tokens per chunk of a non-streaming request's decode "
        "stream after its first, which comes at once (vLLM's per-request "
        "stream_interval): fewer chunks for the decode to send and the proxy "
        "to read. Keep the time that many tokens take well below "
        "timeouts.stream_idle_s; 1 sends no stream_interval (backends without it)",
    )
    on_exhausted: Literal["fail", "decode_only"] = Field(
        default="fail",
        description="fail: 503 with the reason; decode_only: send the original "
        "body to a decode instance, which prefills locally",
    )


class TimeoutsConfig(_Strict):
    connect_s: float = Field(default=3.0, gt=0)
    prefill_s: float = Field(default=60.0, gt=0)
    decode_first_token_s: float = Field(
        default=60.0,
        gt=0,
        description="Until the decode's first data event (non-streaming requests "
        "too, see retry.non_stream_as_stream); then the attempt is retried",
    )
    stream_idle_s: float = Field(
        default=30.0, gt=0, description="Longest gap between a decode's chunks"
    )
    total_s: float = Field(default=600.0, gt=0)
    backend_keepalive_s: float = Field(
        default=4.0,
        gt=0,
        description="Pooled backend connections idle longer are closed; keep it "
        "below the backends' idle timeout (vLLM's uvicorn: 5 s). Read at start",
    )
    request_body_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait for a client's whole request body, then 408",
    )


class HealthConfig(_Strict):
    """Active GET /health probes; passive failures count towards the same threshold."""

    enabled: bool = True
    path: str = "/health"
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    unhealthy_threshold: int = Field(default=2, ge=1)
    healthy_threshold: int = Field(default=1, ge=1)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        base = "http://instance:8000"
        try:
            url = URL(base + value)
        except ValueError:
            url = None
        # Appended to each instance's URL: it must not change the host.
        if url is None or not value.startswith("/") or str(url.origin()) != base:
            raise ValueError(f"must be an absolute path such as /health, got {value!r}")
        return value


class DiscoveryConfig(_Strict):
    """DNS discovery for ``dns:`` pool entries (``proxy.discovery``).

    A new address starts out of rotation until a health probe passes; an
    address that leaves DNS is drained (requests in flight finish) and then
    removed. A failed lookup keeps the addresses last seen.
    """

    interval_s: float = Field(default=10.0, gt=0, description="Re-resolve period")
    timeout_s: float = Field(
        default=2.0,
        gt=0,
        # c-ares takes it in milliseconds, as a C int: above, no resolver.
        le=(2**31 - 1) // 1000,
        description="One lookup's limit",
    )
    nameservers: list[str] | None = Field(
        default=None,
        description='DNS servers to ask, e.g. ["10.96.0.10", "127.0.0.1:5353"]; '
        "default: the system resolver (getaddrinfo: /etc/hosts, resolv.conf and "
        "its search domains)",
    )

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("give at least one nameserver, or leave it unset")
        return None if value is None else [_nameserver(v) for v in value]


class EjectionConfig(_Strict):
    """KV integrity failures → ejection for a cooldown, then probed back."""

    enabled: bool = True
    window_s: float = Field(default=60.0, gt=0)
    instance_failures: int = Field(
        default=3,
        ge=1,
        description="Failures blamed on one instance within the window that eject it",
    )
    pair_failures: int = Field(
        default=5,
        ge=1,
        description="Failures of one prefill-decode pair within the window that "
        "eject the pair",
    )
    cooldown_s: float = Field(default=30.0, gt=0)


class LimitsConfig(_Strict):
    max_in_flight: int = Field(default=4096, ge=1, description="Above it: 429")
    max_body_bytes: int = Field(default=10 * 1024 * 1024, ge=1024, description="413")
    max_reply_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest backend reply read (prefill JSON, non-streamed "
        "decode) and most a decode may stream before its first output (held "
        "for a retry); more fails the attempt",
    )


class AuthConfig(_Strict):
    """Keys come from the environment or files, never from the YAML itself."""

    api_keys_env: str | None = Field(
        default=None, description="Env var with inbound keys, comma-separated"
    )
    api_keys_file: str | None = Field(
        default=None, description="File with inbound keys, one per line"
    )
    admin_key_env: str | None = None
    admin_key_file: str | None = None
    backend_api_key_env: str | None = Field(
        default=None, description="Env var with the key sent to backends"
    )
    backend_api_key_file: str | None = None
    metrics_key_env: str | None = Field(
        default=None,
        description="Env var with the keys /metrics requires (it names the "
        "backends' URLs); unset: /metrics is open",
    )
    metrics_key_file: str | None = None


class RoutingConfig(_Strict):
    prefix_hash_bytes: int = Field(
        default=256,
        ge=1,
        description="prefix_hash: bytes of the prompt (or messages) hashed",
    )


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    attempts: bool = Field(default=True, description="One JSON line per attempt")


class ProxyConfig(_Strict):
    """The whole proxy configuration."""

    server: ServerConfig = ServerConfig()
    models: dict[str, ModelConfig] = Field(
        min_length=1,
        description='Model name -> pools; "*" serves any other model name',
    )
    retry: RetryConfig = RetryConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    ejection: EjectionConfig = EjectionConfig()
    limits: LimitsConfig = LimitsConfig()
    auth: AuthConfig = AuthConfig()
    routing: RoutingConfig = RoutingConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # A section left with only comments in YAML is null: take its defaults.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "models"}
        return data

    @model_validator(mode="after")
    def _backoff(self) -> ProxyConfig:
        if self.retry.backoff_max_s < self.retry.backoff_base_s:
            raise ValueError("retry.backoff_max_s must be >= retry.backoff_base_s")
        return self


def json_schema() -> dict[str, Any]:
    """The configuration's JSON schema (``kvguard proxy --print-schema``)."""
    return ProxyConfig.model_json_schema()


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based YAML line of the node at ``loc``, or its nearest parent's."""
    node = root
    line = None if node is None else node.start_mark.line + 1
    for part in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if getattr(key, "value", None) == str(part):
                    child = value
                    line = key.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(part, int)
            and 0 <= part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def format_validation_error(
    err: ValidationError, source: str, root: yaml.Node | None = None
) -> str:
    """One line per problem: ``source:line: field.path: why``."""
    lines = []
    for item in err.errors(include_url=False):
        loc = tuple(item["loc"])
        field = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(root, loc)
        where = f"{source}:{line}" if line else source
        why = item["msg"]
        if item["type"] == "extra_forbidden":
            why = "unknown field"
        elif item["type"] == "missing":
            why = "required field missing"
        lines.append(f"{where}: {field}: {why}")
    return "\n".join(lines)


def parse_config(text: str, source: str = "<config>") -> ProxyConfig:
    """Parses and validates YAML text.

    Raises:
        ConfigError: YAML syntax error or a field that fails validation.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from exc
    except RecursionError:
        # PyYAML composes nested collections recursively.
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return ProxyConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, root)) from exc


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (it
    would keep the last silently: a second ``decode:`` would drop the first)."""

    def construct_mapping(
        self, node: yaml.MappingNode, deep: bool = False
    ) -> dict[Any, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            # Keys a merge (<<) brings may be overridden: only written ones count.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(
                ":merge"
            ):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found the key {key_node.value!r} twice",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's, with the errors its scalar constructors let through (a
        date such as 2001-02-30, ``!!int abc``, ``!!bool x``) as YAML errors
        that point at the node."""
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:
            kind = node.tag.rsplit(":", 1)[-1]
            why = f": {exc}" if isinstance(exc, ValueError) else ""
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"cannot read {node.value!r} as a {kind}{why}",
                node.start_mark,
            ) from exc


def with_overrides(
    config: ProxyConfig, overrides: Mapping[str, Mapping[str, Any]]
) -> ProxyConfig:
    """``config`` with the command line's settings (section -> field -> value)
    on top; they hold across reloads too.

    Raises:
        ConfigError: an override fails its section's validation.
    """
    for section, values in overrides.items():
        current = getattr(config, section)
        try:
            updated = type(current).model_validate({**current.model_dump(), **values})
        except ValidationError as exc:
            where = f"command line ({section})"
            raise ConfigError(format_validation_error(exc, where)) from exc
        config = config.model_copy(update={section: updated})
    return config


def load_config(path: str | os.PathLike[str]) -> ProxyConfig:
    """Reads and validates a YAML file.

    Raises:
        ConfigError: unreadable file, YAML syntax error or invalid field.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from exc
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"{path!r}: cannot read: {exc}") from exc
    return parse_config(text, str(path))


def config_from_urls(
    prefill: list[str],
    decode: list[str],
    model: str = ANY_MODEL,
    **sections: Any,
) -> ProxyConfig:
    """A configuration for one model from plain URL lists (the no-YAML start).

    Raises:
        ConfigError: a bad URL or an empty list.
    """
    data: dict[str, Any] = {
        "models": {
            model: {
                "prefill": {"instances": [{"url": u} for u in prefill]},
                "decode": {"instances": [{"url": u} for u in decode]},
            }
        },
        **sections,
    }
    try:
        return ProxyConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "command line")) from exc


def read_secret(env: str | None, file: str | None, what: str) -> list[str]:
    """Keys from an env var (comma-separated) and/or a file (one per line, # comments).

    Raises:
        ConfigError: the variable is unset or the file is unreadable.
    """
    keys: list[str] = []
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"{what}: environment variable {env} is not set")
        keys += [k.strip() for k in value.split(",") if k.strip()]
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{what}: cannot read {file}: {exc.strerror}") from exc
        except UnicodeDecodeError:
            raise ConfigError(f"{what}: {file} is not UTF-8 text") from None
        except ValueError as exc:  # a NUL in the path
            raise ConfigError(f"{what}: cannot read {file!r}: {exc}") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    if (env is not None or file is not None) and not keys:
        raise ConfigError(f"{what}: no key found in {env or file}")
    return keys
