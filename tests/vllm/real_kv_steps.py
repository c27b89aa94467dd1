"""A P/D pair of vLLM 0.32's real schedulers, each with one worker-side
``KVGuardConnector`` over real (small, bfloat16) KV tensors, stepped in
process through vLLM's own worker hook (``_get_kv_connector_output``): the
checksums are the real kernel's over the KV each side holds.

Only the transfer is played: the worker's inner connector is
:class:`LoopbackConnector`, which reports the loads and sends a test hands
it, and the test copies the producer's blocks into the consumer's (or
corrupts them on the way) before the load is reported finished.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import vllm.distributed.parallel_state as parallel_state
import vllm.v1.worker.kv_connector_model_runner_mixin as mixin
from engine_steps import (
    HEAD_SIZE,
    LAYERS,
    NUM_KV_HEADS,
    kv_cache_config,
    make_scheduler,
    producer_request,
    runner_output,
    shipped,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.fault import KVGuardFaultInjectionConnector

# The inner connector of the workers built here (module path: this module).
LOOPBACK = {
    "kv_connector": "LoopbackConnector",
    "kv_connector_module_path": __name__,
}


class LoopbackStats(KVConnectorStats):
    """The inner connector's own stats: how many transfers it reported."""

    def reset(self) -> None:
        self.data = {"transfers": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["transfers"] += other.data["transfers"]
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data["transfers"]


class LoopbackConnector(KVConnectorBase_V1):
    """A worker's inner connector whose transfers are played by the test:
    the next ``get_transfer_results`` reports what :meth:`report` was
    given, and its stats count the transfers reported."""

    def __init__(
        self,
        vllm_config: Any,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.registered: dict[str, torch.Tensor] = {}
        self.bound: list[KVConnectorMetadata] = []
        self._next = KVConnectorTransferResults()
        self._transfers = 0

    def report(self, results: KVConnectorTransferResults) -> None:
        """What the next step's ``get_transfer_results`` returns."""
        self._next = results

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.registered = dict(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.bound.append(connector_metadata)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        results, self._next = self._next, KVConnectorTransferResults()
        self._transfers += len(results.finished_recving) + len(results.finished_sending)
        return results

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._transfers:
            return None
        stats, self._transfers = LoopbackStats({"transfers": self._transfers}), 0
        return stats

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        raise AssertionError("a worker's inner connector")

    def update_state_after_alloc(self, *args: Any) -> None:
        raise AssertionError("a worker's inner connector")

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        raise AssertionError("a worker's inner connector")


@contextmanager
def _rank_zero() -> Iterator[None]:
    """vLLM's TP and PP groups as a single worker's (rank 0 of 1 each)."""
    group = SimpleNamespace(rank_in_group=0, world_size=1)
    with (
        mock.patch.object(parallel_state, "get_tp_group", lambda: group),
        mock.patch.object(parallel_state, "get_pp_group", lambda: group),
    ):
        yield


class Engine:
    """One engine: vLLM's scheduler of class ``cls`` with KVGuardConnector
    around NIXL's scheduler half, and one worker whose KVGuardConnector
    wraps a :class:`LoopbackConnector` and registers real KV tensors
    (``kv``, per layer ``[blocks, heads, block_size, K then V]``). With
    ``faults`` (``fault_injection`` settings) the worker's connector is
    ``KVGuardFaultInjectionConnector``."""

    def __init__(
        self,
        role: str,
        cls: type[Scheduler] = Scheduler,
        *,
        num_blocks: int = 64,
        faults: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        self.scheduler = make_scheduler(
            cls, vllm_config(role, num_blocks=num_blocks, **config)
        )
        connector_cls = KVGuardConnector
        if faults is not None:
            connector_cls = KVGuardFaultInjectionConnector
            config |= {"connector": connector_cls.__name__, "faults": faults}
        worker_config = vllm_config(
            role, num_blocks=num_blocks, inner=LOOPBACK, **config
        )
        self.connector = connector_cls(
            worker_config, KVConnectorRole.WORKER, kv_cache_config(worker_config)
        )
        inner = self.connector.inner
        assert isinstance(inner, LoopbackConnector)
        self.inner = inner
        block_size = worker_config.cache_config.block_size
        self.kv = {
            name: torch.zeros(
                num_blocks,
                NUM_KV_HEADS,
                block_size,
                2 * HEAD_SIZE,
                dtype=torch.bfloat16,
            )
            for name in LAYERS
        }
        with _rank_zero():
            self.connector.register_kv_caches(self.kv)
        # Per step, the worker's connector output (its stats, its KVGuard
        # report); the last step's engine outputs.
        self.worker_outputs: list[KVConnectorOutput] = []
        self.outputs: dict[int, Any] = {}

    def step(
        self,
        results: KVConnectorTransferResults | None = None,
        forward: Callable[[], None] | None = None,
    ) -> set[str]:
        """One engine step, the worker's inner connector reporting
        ``results``; the requests it scheduled. The step's forward writes
        the KV of the prompt tokens it computes (:meth:`write_prompt`), then
        calls ``forward``."""
        if results is not None:
            self.inner.report(results)
        out = self.scheduler.schedule()
        connector = self.connector
        with (
            mock.patch.object(mixin, "get_kv_transfer_group", lambda: connector),
            mock.patch.object(mixin, "has_kv_transfer_group", lambda: True),
            mock.patch.object(mixin, "get_forward_context", lambda: None),
            mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(
                shipped(out)
            ) as output,
        ):
            for req_id, num_tokens in out.num_scheduled_tokens.items():
                req = self.scheduler.requests[req_id]
                if req.num_computed_tokens < req.num_prompt_tokens:
                    end = req.num_computed_tokens + num_tokens
                    self.write_prompt(req_id, req.num_computed_tokens, end)
            if forward is not None:
                forward()
        self.worker_outputs.append(output)
        self.outputs = self.scheduler.update_from_output(
            out, shipped(runner_output(out, output))
        )
        return set(out.num_scheduled_tokens)

    def block_ids(self, req_id: str) -> list[int]:
        """The request's blocks in this engine's KV cache."""
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    def write_prompt(self, req_id: str, start: int, end: int) -> None:
        """The KV of tokens ``[start, end)`` of the request, as a forward
        would write it: values of the request, layer and tokens."""
        block_size = self.scheduler.cache_config.block_size
        ids = torch.tensor(self.block_ids(req_id))
        tokens = torch.arange(start, end)
        blocks, slots = ids[tokens // block_size], tokens % block_size
        for index, kv in enumerate(self.kv.values()):
            seed = zlib.crc32(f"{req_id}/{index}/{start}/{end}".encode())
            values = torch.randn(
                end - start,
                NUM_KV_HEADS,
                2 * HEAD_SIZE,
                generator=torch.Generator().manual_seed(seed),
            )
            kv[blocks, :, slots] = values.to(torch.bfloat16)

    def kv_params(self, req_id: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a request the last step finished."""
        for outputs in self.outputs.values():
            for out in outputs.outputs:
                if out.request_id == req_id and out.kv_transfer_params:
                    return dict(out.kv_transfer_params)
        raise AssertionError(f"no kv_transfer_params of {req_id}")


def prefill(producer: Engine, req_id: str, num_tokens: int) -> dict[str, Any]:
    """A P/D prefill on ``producer``: the request's params for the decode."""
    block_size = producer.scheduler.cache_config.block_size
    producer.scheduler.add_request(producer_request(req_id, num_tokens, block_size))
    assert req_id in producer.step()
    return producer.kv_params(req_id)


def copy_blocks(
    producer: Engine, remote_ids: list[int], consumer: Engine, local_ids: list[int]
) -> None:
    """The transfer: the producer's blocks into the consumer's, layer by
    layer (what NIXL's read does)."""
    for name, kv in consumer.kv.items():
        kv[local_ids] = producer.kv[name][remote_ids]
