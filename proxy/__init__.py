"""KVGuard's prefill/decode proxy: HTTP and routing only (no torch, no engine_patch).

``create_app(config)`` builds the aiohttp application; ``proxy.cli.main`` runs it.
"""

from proxy.app import create_app
from proxy.config import ConfigError, ProxyConfig, load_config, parse_config
from proxy.state import ProxyState

__all__ = [
    "ConfigError",
    "ProxyConfig",
    "ProxyState",
    "create_app",
    "load_config",
    "parse_config",
]
