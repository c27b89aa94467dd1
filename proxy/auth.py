"""Inbound API keys and the admin key, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from proxy.config import AuthConfig, ConfigError, InstanceConfig, read_secret


def bearer(headers: Mapping[str, str]) -> bytes | None:
    """The token of an ``Authorization: Bearer`` header, as bytes.

    aiohttp keeps bytes that are not UTF-8 as surrogates; they come back as
    the client's bytes, which then simply match no key.
    """
    value = headers.get("Authorization")
    if value is None or value[:7].lower() != "bearer ":
        return None
    return value[7:].strip().encode("utf-8", "surrogateescape")


class Keys:
    """A set of accepted keys; empty means no key is required."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def accepts(self, token: bytes | None) -> bool:
        """True when ``token`` matches a key; every key is compared, no early exit."""
        if token is None:
            return False
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(key, token)
        return ok


class Auth:
    """What the configuration's ``auth`` section resolves to at (re)load."""

    def __init__(
        self,
        clients: Keys,
        admin: Keys,
        backend_key: str | None,
        metrics: Keys | None = None,
    ) -> None:
        self.clients = clients
        self.admin = admin
        self.backend_key = backend_key
        self.metrics = metrics or Keys([])

    def instance_key(self, entry: InstanceConfig) -> str | None:
        """The API key the proxy sends to ``entry``'s instances: its own,
        else the backend key.

        Raises:
            ConfigError: the entry's key file or variable cannot be read.
        """
        keys = read_secret(
            entry.api_key_env, entry.api_key_file, f"{entry.key} api key"
        )
        return keys[0] if keys else self.backend_key

    @classmethod
    def from_config(cls, cfg: AuthConfig) -> Auth:
        """Reads keys from the environment and files.

        Raises:
            ConfigError: a named variable is unset or a file is unreadable.
        """
        clients = read_secret(cfg.api_keys_env, cfg.api_keys_file, "auth.api_keys")
        admin = read_secret(cfg.admin_key_env, cfg.admin_key_file, "auth.admin_key")
        backend = read_secret(
            cfg.backend_api_key_env, cfg.backend_api_key_file, "auth.backend_api_key"
        )
        if len(backend) > 1:
            raise ConfigError("auth.backend_api_key: expected one key, found several")
        metrics = read_secret(
            cfg.metrics_key_env, cfg.metrics_key_file, "auth.metrics_key"
        )
        return cls(
            Keys(clients),
            Keys(admin),
            backend[0] if backend else None,
            Keys(metrics),
        )
