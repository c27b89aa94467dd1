"""KVGuard for an unmodified vLLM (0.32): a KV connector that wraps the
deployment's real connector and checksums the KV it moves.

Load it with ``--kv-transfer-config``::

    {"kv_connector": "KVGuardConnector",
     "kv_connector_module_path": "engine_patch.vllm",
     "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
     "kv_load_failure_policy": "fail",
     "kv_connector_extra_config": {
         "inner": {"kv_connector": "NixlConnector"},
         "kv_checksums": {"fail_closed": true}}}

Importing this package needs vLLM; nothing else in engine_patch imports it.
"""

from engine_patch.vllm.config import KVGuardConfigError
from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.fault import KVGuardFaultInjectionConnector

__all__ = [
    "KVGuardConfigError",
    "KVGuardConnector",
    "KVGuardFaultInjectionConnector",
]
