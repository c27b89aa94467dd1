"""KVGuard's prefill/decode proxy: HTTP and routing only (no torch, no engine_patch).

``create_app(config)`` builds the aiohttp application; ``proxy.cli.main`` runs it.
"""

from proxy.app import ProxyState, create_app
from proxy.config import ConfigError, ProxyConfig, load_config, parse_config

__all__ = [
    "ConfigError",
    "ProxyConfig",
    "ProxyState",
    "create_app",
    "load_config",
    "parse_config",
]
