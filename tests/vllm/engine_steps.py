"""vLLM 0.32's real scheduler with KVGuardConnector (around NixlConnector's
scheduler half), stepped in process without workers or a model: the
tests and the scheduler-cost benchmark play the workers' part, handing
each step a ``ModelRunnerOutput`` with the connector output they choose.

Needs vLLM importable and the tiny model's config (``ensure_model``).
"""

from __future__ import annotations

import os
import pickle
import random
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm_servers import ensure_model

from engine_patch.payload import KVChecksumPayload
from engine_patch.types import KVChecksumGroup, KVChecksumRecord
from engine_patch.vllm.metadata import (
    KVGuardConnectorMetadata,
    KVGuardWorkerMetadata,
    WorkerReport,
)

BLOCK_SIZE = 32
NUM_BLOCKS = 1024
MAX_MODEL_LEN = 512
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_KV_HEADS = 2
HEAD_SIZE = 32
# The checksums' identity of the layers (any value, the same on both sides).
FINGERPRINT = 0x5EED
TOKEN = 7

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Longer prompts than the tiny model's positions, for the scheduler only.
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def vllm_config(
    role: str,
    *,
    fail_closed: bool = True,
    checksums: bool = True,
    policy: str = "fail",
    connector: str = "KVGuardConnector",
    block_size: int = BLOCK_SIZE,
    max_model_len: int = MAX_MODEL_LEN,
    num_blocks: int = NUM_BLOCKS,
    prompts_per_step: int = 1,
    inner: dict[str, Any] | None = None,
    faults: dict[str, Any] | None = None,
) -> VllmConfig:
    """A CPU engine's config for the tiny model with KVGuard (checksums on,
    fail-closed by default) around NIXL (or the ``inner`` connector
    config), its ``fault_injection`` settings ``faults`` if given (for
    ``KVGuardFaultInjectionConnector``); one step prefills
    ``prompts_per_step`` whole prompts."""
    transfer: dict[str, Any] = {
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": policy,
    }
    if connector == "NixlConnector":
        transfer["kv_connector"] = connector
    else:
        transfer |= {
            "kv_connector": connector,
            "kv_connector_module_path": "engine_patch.vllm",
            "kv_connector_extra_config": {
                "kv_checksums": {"enabled": checksums, "fail_closed": fail_closed}
            },
        }
        if inner is not None:
            transfer["kv_connector_extra_config"]["inner"] = inner
        if faults is not None:
            transfer["kv_connector_extra_config"]["fault_injection"] = faults
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(ensure_model()), dtype="bfloat16", max_model_len=max_model_len
        ),
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max(4, prompts_per_step),
            max_num_batched_tokens=max_model_len * prompts_per_step,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(**transfer),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def kv_cache_config(config: VllmConfig) -> KVCacheConfig:
    """The tiny model's KV cache as vLLM plans it for ``config``: one
    full-attention group of :data:`LAYERS`, 2 KV heads of 32 (bfloat16)."""
    block_size = config.cache_config.block_size
    num_blocks = config.cache_config.num_gpu_blocks
    assert num_blocks is not None
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.bfloat16,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )


def make_scheduler(cls: type[Scheduler], config: VllmConfig) -> Scheduler:
    """A scheduler of class ``cls`` as vLLM's engine core builds it (with
    ``cls`` in the config, as ``--scheduler-cls`` puts it)."""
    config.scheduler_config.scheduler_cls = cls
    block_size = config.cache_config.block_size
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config(config),
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )


_hash_fn = get_hash_fn_by_name("sha256")
init_none_hash(_hash_fn)


def request(
    req_id: str,
    num_tokens: int,
    kv_transfer_params: dict[str, Any] | None,
    max_tokens: int = 4,
    block_size: int = BLOCK_SIZE,
    prompt: list[int] | None = None,
) -> Request:
    """A request of ``num_tokens`` prompt tokens, with the engine's block
    hasher: ``prompt``'s first ones, or its own (no prefix in common with
    another's)."""
    extra_args = {"kv_transfer_params": kv_transfer_params}
    if prompt is None:
        rng = random.Random(zlib.crc32(req_id.encode()))
        prompt = [rng.randrange(2, 500) for _ in range(num_tokens)]
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt[:num_tokens],
        sampling_params=SamplingParams(
            max_tokens=max_tokens, temperature=0.0, extra_args=extra_args
        ),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, _hash_fn),
    )


def producer_request(
    req_id: str, num_tokens: int, block_size: int = BLOCK_SIZE
) -> Request:
    """A P/D prefill as the proxy sends it to a producer: its KV is for a
    remote decode, and it stops after one token."""
    return request(
        req_id,
        num_tokens,
        {"do_remote_decode": True},
        max_tokens=1,
        block_size=block_size,
    )


def cached_tokens(scheduler: Scheduler, tokens: list[int]) -> int:
    """How many of a new local request's prompt tokens vLLM's prefix cache
    would serve it."""
    later = request("later", len(tokens), None, prompt=tokens)
    _, num_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(later)
    return int(num_hit_tokens)


def block_checksums(
    num_tokens: int, seed: int = 1, block_size: int = BLOCK_SIZE
) -> np.ndarray:
    """Made-up checksums, one per block of ``num_tokens`` tokens."""
    num_blocks = -(-num_tokens // block_size)
    return np.arange(seed, seed + num_blocks, dtype=np.uint64) * np.uint64(
        0x9E3779B97F4A7C15
    )


def consumer_params(
    num_tokens: int, checksums: np.ndarray | None, block_size: int = BLOCK_SIZE
) -> dict[str, Any]:
    """A producer's kv_transfer_params as the proxy hands them to a consumer,
    with ``checksums`` (one per block) as the producer's payload."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "producer-engine",
        "remote_request_id": "producer-request",
        "remote_block_ids": [list(range(-(-num_tokens // block_size)))],
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_num_tokens": num_tokens,
    }
    if checksums is not None:
        payload = KVChecksumPayload(
            1, num_tokens, {0: (FINGERPRINT, block_size, 0, checksums)}
        )
        params["kv_checksums"] = payload.to_base64()
    return params


def worker_record(
    checksums: dict[str, np.ndarray],
    tp_rank: int = 0,
    starts: dict[str, int] | None = None,
) -> KVChecksumRecord:
    """One worker's record (TP rank ``tp_rank``, PP 1): per request, its
    checksums of the request's blocks from position 0 (or ``starts``'s)."""
    starts = starts or {}
    return KVChecksumRecord(
        pp_rank=0,
        tp_rank=tp_rank,
        checksums={
            req_id: {
                0: KVChecksumGroup(
                    starts.get(req_id, 0), [(1, 0)], values.reshape(-1, 1).copy()
                )
            }
            for req_id, values in checksums.items()
        },
        fingerprints={0: FINGERPRINT},
    )


@dataclass
class Workers:
    """What the step's workers report: loads finished (and checksummed) or
    failed, loads checksummed but held back from vLLM (connector-only
    mode), sends finished, and the checksums computed. ``kvguard``: whether
    KVGuard's workers report (its worker metadata)."""

    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    checksums: dict[str, np.ndarray] = field(default_factory=dict)
    # The block position each request's checksums start at (default 0).
    starts: dict[str, int] = field(default_factory=dict)
    kvguard: bool = True
    # Requests the step prefilled a chunk of, not the prompt's last: no
    # token sampled.
    prefilling: set[str] = field(default_factory=set)

    def connector_output(self) -> KVConnectorOutput:
        meta = None
        checksummed = (self.finished_recving - self.failed_recving) | self.held
        if self.kvguard and (self.checksums or checksummed):
            record = (
                worker_record(self.checksums, starts=self.starts)
                if self.checksums
                else None
            )
            meta = KVGuardWorkerMetadata(
                None, [WorkerReport(record, sorted(checksummed))]
            )
        return KVConnectorOutput(
            finished_recving=set(self.finished_recving) or None,
            failed_recving=set(self.failed_recving),
            finished_sending=set(self.finished_sending) or None,
            kv_connector_worker_meta=meta,
        )


def runner_output(
    scheduler_output: SchedulerOutput,
    connector_output: KVConnectorOutput | None,
    prefilling: Collection[str] = (),
) -> ModelRunnerOutput:
    """The step's model output: one token for every request that finished
    its prompt (or decodes), none for those still ``prefilling`` (a chunk of
    their prompt), and ``connector_output``."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[] if r in prefilling else [TOKEN] for r in req_ids],
        kv_connector_output=connector_output,
    )


def shipped(obj: Any) -> Any:
    """A copy of ``obj`` as vLLM's multiprocess executor sends it between the
    engine and its workers: pickled."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def step(
    scheduler: Scheduler, workers: Workers | None = None, pickled: bool = False
) -> tuple[SchedulerOutput, Any]:
    """One engine step: schedule, then the workers' output; the scheduler
    output and the engine outputs of ``update_from_output``. ``pickled``:
    the workers' output reaches the scheduler pickled, as from worker
    processes."""
    output = scheduler.schedule()
    connector_output = workers.connector_output() if workers else KVConnectorOutput()
    model_output = runner_output(
        output, connector_output, workers.prefilling if workers else ()
    )
    if pickled:
        model_output = shipped(model_output)
    return output, scheduler.update_from_output(output, model_output)


def kvguard_metadata(output: SchedulerOutput) -> KVGuardConnectorMetadata:
    """The step's metadata for KVGuard's workers."""
    meta = output.kv_connector_metadata
    assert isinstance(meta, KVGuardConnectorMetadata)
    return meta


def scheduled_ids(output: SchedulerOutput) -> set[str]:
    return set(output.num_scheduled_tokens)


def finished(engine_outputs: Any) -> dict[str, Any]:
    """The requests finished in a step's engine outputs, by id: their finish
    reasons."""
    done: dict[str, Any] = {}
    for outputs in engine_outputs.values():
        for out in outputs.outputs:
            if out.finish_reason is not None:
                done[out.request_id] = out.finish_reason
    return done


def kvguard_counts(engine_outputs: Any) -> dict[str, Any]:
    """KVGuard's counts in a step's scheduler stats (empty if none)."""
    for outputs in engine_outputs.values():
        stats = outputs.scheduler_stats
        if stats is not None and stats.kv_connector_stats:
            return dict(stats.kv_connector_stats.get("kv_checksums", {}))
    return {}


def produce(
    scheduler: Scheduler,
    req_id: str,
    num_tokens: int,
    idle_steps: int = 0,
    pickled: bool = False,
) -> dict[str, Any]:
    """A producer request's life: its prefill step (its checksums computed
    by the workers), ``idle_steps`` while NIXL holds its blocks, the step
    that reports them sent. KVGuard's counts summed over the steps;
    ``pickled`` as for :func:`step`."""
    return produce_together(scheduler, [req_id], num_tokens, idle_steps, pickled)


def produce_together(
    scheduler: Scheduler,
    req_ids: Sequence[str],
    num_tokens: int,
    idle_steps: int = 0,
    pickled: bool = False,
    kvguard: bool = True,
    chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """:func:`produce` for several requests whose steps are the same ones
    (the scheduler's budget must fit their prompts in one step, or with
    ``chunk_tokens``, a chunk of that many tokens of each: chunked
    prefill); without ``kvguard``, the workers are plain NIXL's (no
    checksums reported)."""
    block_size = scheduler.cache_config.block_size
    for req_id in req_ids:
        scheduler.add_request(producer_request(req_id, num_tokens, block_size))
    sums = block_checksums(num_tokens, block_size=block_size)
    chunks = -(-num_tokens // chunk_tokens) if chunk_tokens else 1
    steps = [
        Workers(prefilling=set(req_ids), kvguard=kvguard) for _ in range(chunks - 1)
    ]
    steps.append(Workers(checksums=dict.fromkeys(req_ids, sums), kvguard=kvguard))
    steps += [Workers(kvguard=kvguard) for _ in range(idle_steps)]
    steps.append(Workers(finished_sending=set(req_ids), kvguard=kvguard))
    return _run(scheduler, steps, pickled)


def consume(
    scheduler: Scheduler,
    req_id: str,
    num_tokens: int,
    corrupt: bool = False,
    pickled: bool = False,
) -> dict[str, Any]:
    """A consumer request's load and first token: the step that starts the
    load, the step whose workers finish (and checksum) it, the next step.
    KVGuard's counts summed over the steps; ``pickled`` as for :func:`step`."""
    return consume_together(scheduler, [req_id], num_tokens, corrupt, pickled)


def consume_together(
    scheduler: Scheduler,
    req_ids: Sequence[str],
    num_tokens: int,
    corrupt: bool = False,
    pickled: bool = False,
    kvguard: bool = True,
) -> dict[str, Any]:
    """:func:`consume` for several requests whose loads start, finish and
    decode in the same steps (``corrupt`` corrupts each one's); without
    ``kvguard``, the workers are plain NIXL's (no checksums reported)."""
    block_size = scheduler.cache_config.block_size
    sums = block_checksums(num_tokens, block_size=block_size)
    params = consumer_params(num_tokens, sums, block_size=block_size)
    for req_id in req_ids:
        scheduler.add_request(
            request(
                req_id, num_tokens, dict(params), max_tokens=1, block_size=block_size
            )
        )
    loaded = sums.copy()
    if corrupt:
        loaded[0] ^= np.uint64(1)
    return _run(
        scheduler,
        [
            Workers(kvguard=kvguard),
            Workers(
                finished_recving=set(req_ids),
                checksums=dict.fromkeys(req_ids, loaded),
                kvguard=kvguard,
            ),
            Workers(kvguard=kvguard),
        ],
        pickled,
    )


def _run(
    scheduler: Scheduler, steps: list[Workers], pickled: bool = False
) -> dict[str, Any]:
    totals: dict[str, Any] = {}
    for workers in steps:
        _, outputs = step(scheduler, workers, pickled)
        for key, value in kvguard_counts(outputs).items():
            if isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0) + value
    return totals
