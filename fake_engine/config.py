"""Settings of one fake engine: the model's shape, its parallelism and KV
cache, P/D role, KV checksum policy, fault injection and simulated speed."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


class Role(enum.StrEnum):
    """Which side of a P/D pair the engine plays (vLLM's ``kv_role``)."""

    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"

    @property
    def produces(self) -> bool:
        return self is not Role.CONSUMER

    @property
    def consumes(self) -> bool:
        return self is not Role.PRODUCER


class KVLoadFailurePolicy(enum.StrEnum):
    """What a failed KV load does to its request (vLLM's
    ``kv_load_failure_policy``)."""

    FAIL = "fail"
    RECOMPUTE = "recompute"


class FaultKind(enum.StrEnum):
    """What goes wrong with a KV transfer."""

    NONE = "none"
    BITFLIP = "bitflip"
    ZERO = "zero"
    SWAP = "swap"
    STALE = "stale"
    TRUNCATE = "truncate"
    SHIFT = "shift"
    HANG = "hang"
    SLOW = "slow"

    @property
    def corrupts(self) -> bool:
        """Whether the fault changes KV bytes (hang and slow only delay)."""
        return self not in (FaultKind.NONE, FaultKind.HANG, FaultKind.SLOW)


class FaultSide(enum.StrEnum):
    """Where a fault strikes: the producer serves bad blocks, or the
    consumer lands them badly."""

    PRODUCER = "producer"
    CONSUMER = "consumer"


# --dtype names -> the KV cache's element type. fp8 is stored as uint8, as
# vLLM stores an fp8 KV cache.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class FaultConfig:
    """A fault to inject into KV transfers: on a share ``rate`` of them, for
    the next ``count`` (None: no limit). ``delay_s`` is how long ``slow``
    delays a transfer."""

    fault: FaultKind = FaultKind.NONE
    side: FaultSide = FaultSide.PRODUCER
    rate: float = 1.0
    count: int | None = None
    delay_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {self.rate}")
        if self.count is not None and not (
            isinstance(self.count, int) and self.count >= 0
        ):
            raise ValueError(
                f"fault count must be a whole number >= 0, got {self.count}"
            )
        if not self.delay_s >= 0.0:
            raise ValueError(f"fault delay must be >= 0, got {self.delay_s}")


@dataclass(frozen=True)
class EngineConfig:
    """One fake engine. The defaults are a small model, for tests; the CLI
    has its own defaults."""

    model: str = "kvguard/fake-model"
    role: Role = Role.BOTH
    # Model shape.
    layers: int = 2
    kv_heads: int = 2
    head_size: int = 16
    dtype: str = "float16"
    # Parallelism and KV cache.
    tp_size: int = 1
    block_size: int = 16
    num_blocks: int = 256
    max_model_len: int = 2048
    max_num_batched_tokens: int = 8192
    # KV checksums (engine_patch).
    kv_checksums: bool = True
    fail_closed: bool = True
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL
    # Seconds a producer holds KV for its consumer (vLLM's kv_lease_duration).
    lease_s: float = 30.0
    # Faults.
    fault: FaultConfig = FaultConfig()
    fault_seed: int = 0
    enable_fault_admin: bool = False
    # Simulated compute speed; None: as fast as the CPU goes.
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    # Identity in kv_transfer_params; None: a random one.
    engine_id: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "layers",
            "kv_heads",
            "head_size",
            "tp_size",
            "block_size",
            "num_blocks",
            "max_model_len",
            "max_num_batched_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be at least 1, got {getattr(self, name)}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        if (self.head_size * self.element_size) % 8:
            raise ValueError(
                "head_size * dtype bytes must be a multiple of 8 (the model "
                "reads KV as 64-bit words)"
            )
        if self.tp_size > self.kv_heads and self.tp_size % self.kv_heads:
            raise ValueError("tp_size must be a multiple of kv_heads when larger")
        if self.tp_size <= self.kv_heads and self.kv_heads % self.tp_size:
            raise ValueError("kv_heads must be a multiple of tp_size")
        # Block 0 is the null block.
        if (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.num_blocks} blocks of {self.block_size} tokens cannot "
                f"hold max_model_len={self.max_model_len} tokens"
            )
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {self.lease_s}")
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype: fp8 is stored as uint8."""
        return torch.uint8 if self.dtype == "fp8" else self.torch_dtype

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.kv_heads // self.tp_size)

    @property
    def head_replicas(self) -> int:
        """Ranks holding a copy of each KV head (TP beyond the KV heads)."""
        return max(1, self.tp_size // self.kv_heads)

    @property
    def max_blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)
