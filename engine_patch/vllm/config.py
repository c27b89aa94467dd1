"""KVGuard's settings in ``--kv-transfer-config``'s ``kv_connector_extra_config``::

    {"kv_connector": "KVGuardConnector",
     "kv_connector_module_path": "engine_patch.vllm",
     "kv_role": "kv_producer", "kv_buffer_device": "cpu",
     "kv_connector_extra_config": {
         "inner": {"kv_connector": "NixlConnector"},
         "kv_checksums": {"fail_closed": true}}}

``inner`` is the deployment's real connector, a ``KVTransferConfig`` of its
own like one of MultiConnector's ``connectors``; fields it leaves out (role,
buffer device, engine id, failure policy) are the outer config's. What a
failed verification does is vLLM's own ``kv_load_failure_policy``.
"""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from engine_patch.config import KVChecksumConfig

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBaseType
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Connector names of KVGuard itself: an inner connector cannot be one.
KVGUARD_CONNECTORS = frozenset({"KVGuardConnector", "KVGuardFaultInjectionConnector"})

DEFAULT_INNER: dict[str, Any] = {"kv_connector": "NixlConnector"}

# Outer fields the inner connector's config inherits unless it sets them.
_INHERITED = ("engine_id", "kv_buffer_device", "kv_role", "kv_port",
              "enable_permute_local_kv", "kv_load_failure_policy")  # fmt: skip


# Of those, the ones vLLM's scheduler reads from the outer config: an inner
# value that differs would be ignored by it, or contradict it.
_OUTER_ONLY = ("kv_role", "kv_load_failure_policy")


class KVGuardConfigError(ValueError):
    """KVGuard's part of ``--kv-transfer-config`` is invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Invalid KVGuard config in --kv-transfer-config: {message}")


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChecksumSettings(_Settings):
    """``kv_checksums``: whether and how loads are verified.

    ``fail_closed`` (the default): a mismatched or unverified load fails, and
    vLLM's ``kv_load_failure_policy`` decides what happens to its request;
    fail-open (``false``, an explicit opt-in for rollouts) counts and logs it
    and lets the request decode.
    ``compile``: run the worker's checksum as one fused kernel (on CPUs an
    AOTInductor package, built once per machine), prepared when the KV
    cache is registered (into ``$VLLM_CACHE_ROOT/kvguard``); unset: on for
    GPUs, off for CPUs, unless ``KVGUARD_CHECKSUM_COMPILE`` says.
    """

    # Strict: "off" or 0 must not turn checksums off without a word.
    enabled: StrictBool = True
    fail_closed: StrictBool = True
    compile: StrictBool | None = None


class FaultSettings(_Settings):
    """``fault_injection`` (KVGuardFaultInjectionConnector only): flip one
    bit of each chosen load's KV after it finishes and before its checksum.

    ``loads``: ``"all"``, ``"every_other"`` (the first, third, ...) or
    ``"first"`` (the first ``count``). ``layers``: the kind of layer whose
    KV (or state) gets the bit, named as the checksum's spec types
    (``"full_attention"``, ``"sliding_window"``, ``"mamba"``); ``"any"``:
    the first loaded group's.
    """

    loads: Literal["all", "every_other", "first"] = "all"
    count: int = Field(default=1, ge=0)
    layers: Literal["any", "full_attention", "sliding_window", "mamba"] = "any"

    def corrupts(self, load_number: int) -> bool:
        """Whether the ``load_number``-th load (from 1) is corrupted."""
        if self.loads == "all":
            return True
        if self.loads == "every_other":
            return load_number % 2 == 1
        return load_number <= self.count


class KVGuardSettings(_Settings):
    """Everything KVGuard reads from ``kv_connector_extra_config``."""

    inner: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_INNER))
    kv_checksums: ChecksumSettings = ChecksumSettings()
    fault_injection: FaultSettings | None = None

    def checksum_config(self, vllm_config: VllmConfig) -> KVChecksumConfig:
        """The engine_patch config of this engine's checksums.

        Raises:
            KVGuardConfigError: If checksums are on and the engine shards
                its KV by context (prefill or decode context parallelism):
                workers' sums are per tensor-parallel and pipeline rank.
        """
        parallel = vllm_config.parallel_config
        contexts = {
            "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
            "decode_context_parallel_size": parallel.decode_context_parallel_size,
        }
        sharded = [f"{name}={size}" for name, size in contexts.items() if size > 1]
        if sharded and self.kv_checksums.enabled:
            raise KVGuardConfigError(
                f"{', '.join(sharded)}: KVGuard's checksums do not support "
                "context parallelism (its workers sum KV per tensor-parallel "
                "and pipeline rank); run without it, or set "
                "kv_checksums.enabled to false"
            )
        return KVChecksumConfig(
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            enabled=self.kv_checksums.enabled,
            fail_closed=self.kv_checksums.fail_closed,
        )


def parse_settings(
    kv_transfer_config: KVTransferConfig, *, fault_injection: bool = False
) -> KVGuardSettings:
    """KVGuard's settings from the outer config's extra config.

    Args:
        kv_transfer_config: The ``--kv-transfer-config`` KVGuard is loaded by.
        fault_injection: Whether the connector injects faults (only then is
            ``fault_injection`` allowed, and then it is required).

    Raises:
        KVGuardConfigError: If a key is unknown or a value invalid.

    """
    extra = kv_transfer_config.kv_connector_extra_config or {}
    try:
        settings = KVGuardSettings.model_validate(extra)
    except ValidationError as e:
        raise KVGuardConfigError(
            "; ".join(_describe(err) for err in e.errors())
        ) from None
    inner_name = settings.inner.get("kv_connector")
    if not isinstance(inner_name, str) or not inner_name:
        raise KVGuardConfigError(
            'inner.kv_connector must name the real connector, e.g. "NixlConnector"'
        )
    if inner_name in KVGUARD_CONNECTORS:
        raise KVGuardConfigError(f"inner.kv_connector cannot be {inner_name} itself")
    if fault_injection and settings.fault_injection is None:
        raise KVGuardConfigError(
            "KVGuardFaultInjectionConnector needs fault_injection, e.g. "
            '{"loads": "every_other"}'
        )
    if not fault_injection and settings.fault_injection is not None:
        raise KVGuardConfigError(
            "fault_injection is only read by KVGuardFaultInjectionConnector "
            '(set "kv_connector": "KVGuardFaultInjectionConnector")'
        )
    if (
        fault_injection
        and not settings.kv_checksums.enabled
        and settings.fault_injection is not None
    ):
        raise KVGuardConfigError(
            "fault_injection needs kv_checksums.enabled: it corrupts the loads "
            "the checksum scheduler tracks"
        )
    return settings


def _describe(error: Any) -> str:
    """One validation error in the config's own terms."""
    loc = [str(part) for part in error["loc"]]
    where = ".".join(loc) or "kv_connector_extra_config"
    if error["type"] == "extra_forbidden":
        model: type[BaseModel] = KVGuardSettings
        for part in loc[:-1]:
            annotation = model.model_fields[part].annotation
            model = next(
                (
                    arg
                    for arg in (annotation, *getattr(annotation, "__args__", ()))
                    if isinstance(arg, type) and issubclass(arg, BaseModel)
                ),
                model,
            )
        known = ", ".join(model.model_fields)
        return f"unknown key {where} (known: {known})"
    return f"{where}: {error['msg']}"


def inner_transfer_config(
    kv_transfer_config: KVTransferConfig, settings: KVGuardSettings
) -> KVTransferConfig:
    """The inner connector's ``KVTransferConfig``: ``settings.inner`` over the
    outer config's role, buffer device, engine id and failure policy.

    Raises:
        KVGuardConfigError: If ``inner`` has fields KVTransferConfig lacks or
            invalid values.

    """
    from vllm.config import KVTransferConfig

    known = {f.name for f in fields(KVTransferConfig)}
    unknown = sorted(set(settings.inner) - known)
    if unknown:
        raise KVGuardConfigError(
            f"inner has fields a KVTransferConfig does not: {', '.join(unknown)}"
        )
    values = {name: getattr(kv_transfer_config, name) for name in _INHERITED}
    for name in _OUTER_ONLY:
        if name in settings.inner and settings.inner[name] != values[name]:
            raise KVGuardConfigError(
                f"inner.{name} is {settings.inner[name]!r} but {name} is "
                f"{values[name]!r}: vLLM's scheduler acts on the outer one, so "
                "the two must agree (leave it out of inner)"
            )
    values.update(copy.deepcopy(settings.inner))
    try:
        return KVTransferConfig(**values)
    except (TypeError, ValueError) as e:
        raise KVGuardConfigError(f"inner: {e}") from None


def inner_vllm_config(vllm_config: VllmConfig, settings: KVGuardSettings) -> VllmConfig:
    """A shallow copy of ``vllm_config`` whose ``kv_transfer_config`` is the
    inner connector's (as MultiConnector builds its children's)."""
    assert vllm_config.kv_transfer_config is not None
    inner = copy.copy(vllm_config)
    inner.kv_transfer_config = inner_transfer_config(
        vllm_config.kv_transfer_config, settings
    )
    return inner


def without_hybrid_manager(
    inner_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> VllmConfig:
    """``inner_config`` with vLLM's hybrid KV cache manager off, as vLLM runs
    an inner connector (or a MultiConnector child) without that support when
    no KVGuard is around it. KVGuard supports it, so vLLM keeps it on; that
    changes nothing for a KV cache of one full-attention group, which the
    manager leaves as it is.

    Raises:
        KVGuardConfigError: If the KV cache is not one full-attention group:
            vLLM would have laid it out otherwise.

    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    assert inner_config.kv_transfer_config is not None
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise KVGuardConfigError(
            f"inner connector {inner_config.kv_transfer_config.kv_connector} "
            "does not support the hybrid KV cache manager (for a MultiConnector: "
            "one of its connectors does not); set --disable-hybrid-kv-cache-manager"
        )
    config = copy.copy(inner_config)
    config.scheduler_config = copy.copy(inner_config.scheduler_config)
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return config


def inner_connector_class(
    kv_transfer_config: KVTransferConfig,
) -> type[KVConnectorBaseType]:
    """The inner connector's class.

    Raises:
        KVGuardConfigError: If it cannot be found or imported.

    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        return KVConnectorFactory.get_connector_class(kv_transfer_config)
    except (ValueError, AttributeError, ImportError) as e:
        raise KVGuardConfigError(
            f"inner connector {kv_transfer_config.kv_connector!r}: {e}"
        ) from None
