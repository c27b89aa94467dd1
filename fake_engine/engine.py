"""The fake engine: a vLLM-like step loop over the fake model's paged KV
cache, P/D transfers in NIXL's pull mode, and engine_patch's KV checksums.

Each step, like vLLM's scheduler and workers: schedule (running requests,
then waiting ones; a consumer's KV load starts instead of its prefill) →
``build_checksum_meta`` → every worker's ``begin_step`` → forward (write
the scheduled tokens' KV, read the sequence's KV back, choose next tokens)
→ ``after_forward`` → ``on_loads_finished`` for loads that finished before
the step → ``take_record`` → ``update_from_output``, whose failed loads the
KV load failure policy handles → outputs, finished requests
(``request_finished`` puts a producer's checksums into its
``kv_transfer_params``).

A producer's finished request keeps its blocks until its consumer pulls
them, it is aborted, or its lease ends. The transfers themselves (the pull's
HTTP and wire format, the leases) are :mod:`fake_engine.transfer`. Model
compute runs in one worker thread per engine, so HTTP keeps being served
during a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine_patch.config import KVChecksumConfig
from engine_patch.hashing import MASK64
from engine_patch.host import KV_SENT_FINISH_REASONS, CacheHitSource, FinishReason
from engine_patch.kv_cache import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from engine_patch.log import get_logger
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.types import KVChecksumRecord, KVChecksumScheduled
from fake_engine.config import (
    EngineConfig,
    FaultConfig,
    FaultKind,
    FaultSide,
    KVLoadFailurePolicy,
)
from fake_engine.faults import Fault, FaultInjector
from fake_engine.kv_cache import BlockPool, KVCacheManager, token_slots
from fake_engine.metrics import EngineMetrics, EngineSnapshot
from fake_engine.model import FakeModel, Processors, TokenLogprob
from fake_engine.request import (
    FINISH_REASON_TEXT,
    EngineRequest,
    RemoteSource,
    RequestOutput,
    RequestStatus,
    SamplingOptions,
)
from fake_engine.transfer import (
    KVHeader,
    KVPuller,
    Leases,
    PullRequest,
    TransferError,
    encode_kv,
)
from fake_engine.workers import TPWorker, layer_name

logger = get_logger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine no longer takes requests."""


class _PDConnector:
    """The connector hooks engine_patch's scheduler calls: consumer requests
    load their external tokens from their producer (P2P); nothing is
    offloaded."""

    def get_external_cache_hit_sources(
        self, request: object, num_external_tokens: int
    ) -> Mapping[CacheHitSource, int]:
        is_remote = isinstance(request, EngineRequest) and request.remote is not None
        if num_external_tokens > 0 and is_remote:
            return {CacheHitSource.P2P: num_external_tokens}
        return {}

    def get_kv_checksum_sources(self, request: object) -> frozenset[CacheHitSource]:
        return frozenset()

    def on_kv_checksum_failure(
        self, request: object, mismatches: dict[int, list[int]]
    ) -> None:
        """Not called: nothing is offloaded."""


@dataclass
class _ConnectorOutput:
    """``engine_patch.host.KVConnectorOutput``."""

    kv_checksums: Sequence[KVChecksumRecord] | None
    finished_recving: Collection[str] | None


@dataclass
class _LoadResult:
    error: str | None = None


@dataclass
class _Scheduled:
    """One request's work in a step: KV of tokens ``[start, end)`` to write,
    then KV of ``[digest_start, end)`` to read back."""

    request: EngineRequest
    start: int
    end: int
    write_slots: torch.Tensor
    digest_start: int
    digest_slots: torch.Tensor
    prefix_hashes: list[int]
    samples: bool
    # The logits processors its sampled token goes through.
    processors: Processors


@dataclass
class _Step:
    scheduled: list[_Scheduled] = field(default_factory=list)
    loads_to_start: list[EngineRequest] = field(default_factory=list)
    finished_loads: dict[str, _LoadResult] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    checksum_meta: KVChecksumScheduled | None = None

    @property
    def empty(self) -> bool:
        """Nothing to run. A step that only tells the workers of finished
        requests runs (vLLM's ``has_finished_requests``): they drop their
        state of them."""
        return not (
            self.scheduled
            or self.loads_to_start
            or self.finished_loads
            or self.finished_req_ids
        )

    def num_prefill_tokens(self) -> int:
        return sum(
            item.end - item.start
            for item in self.scheduled
            if item.start < item.request.num_prompt_tokens - 1
        )


@dataclass
class _StepResult:
    # Per request: its sampled token and, if asked for, its logprobs.
    sampled: dict[str, tuple[int, list[TokenLogprob] | None]]
    records: list[KVChecksumRecord]


class Engine:
    """One fake vLLM engine: its model, KV cache, TP workers, checksum
    scheduler and step loop. Start it in a running event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_id = config.engine_id or str(uuid.uuid4())
        # Where consumers pull from (the HTTP server's address).
        self.host = "127.0.0.1"
        self.port = 0
        self.model = FakeModel(config)
        self.kv = KVCacheManager(BlockPool(config.num_blocks), config.block_size)
        self.workers = [TPWorker(config, rank) for rank in range(config.tp_size)]
        self.faults = FaultInjector(config.fault, config.fault_seed)
        self.kv_cache_config = KVCacheConfig(
            kv_cache_groups=[
                KVCacheGroup(
                    FullAttentionSpec(config.block_size),
                    tuple(layer_name(i) for i in range(config.layers)),
                )
            ],
            hash_block_size=config.block_size,
        )
        self.checksums = KVChecksumScheduler.create(
            KVChecksumConfig(
                tp_size=config.tp_size,
                enabled=config.kv_checksums,
                fail_closed=config.fail_closed,
            ),
            self.kv_cache_config,
            _PDConnector(),
        )
        self.metrics = EngineMetrics(self.snapshot)
        self._requests: dict[str, EngineRequest] = {}
        # Every id a request answers to (the caller's, the response's), and
        # the requests answering to it: a request of n choices or several
        # prompts runs as several.
        self._aliases: dict[str, list[str]] = {}
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._loading: dict[str, EngineRequest] = {}
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._finished_loads: dict[str, _LoadResult] = {}
        self._finished_req_ids: set[str] = set()
        self._leases = Leases(config.lease_s)
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fake-engine")
        self._puller = KVPuller()
        self._tasks: list[asyncio.Task[None]] = []

    # Life cycle.

    async def start(self) -> None:
        await self._puller.start()
        self._tasks = [
            asyncio.create_task(self._step_loop(), name="fake-engine-steps"),
            asyncio.create_task(self._lease_loop(), name="fake-engine-leases"),
        ]

    async def stop(self) -> None:
        """Abort everything in flight and stop."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for task in [*self._tasks, *self._pulls.values()]:
            task.cancel()
        for task in [*self._tasks, *self._pulls.values()]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for request in list(self._requests.values()):
            self._finish(request, FinishReason.ABORT)
        await self._puller.close()
        self._executor.shutdown(wait=True)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # Requests.

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; its outputs arrive on ``request.outputs``.

        Raises:
            EngineStoppedError: If the engine is stopped.

        """
        if self.stopped:
            raise EngineStoppedError("the engine is stopped")
        params = request.kv_transfer_params
        if (
            params
            and params.get("do_remote_prefill")
            and not params.get("do_remote_decode")
        ):
            if self.config.role.consumes:
                request.remote = RemoteSource.from_params(params)
                if request.remote is None:
                    logger.warning(
                        "Got invalid KVTransferParams: %s. This request will "
                        "not utilize KVTransfer",
                        params,
                    )
            else:
                logger.warning(
                    "Request %s asks for a remote prefill but this engine's "
                    "role is %s: prefilling locally.",
                    request.request_id,
                    self.config.role,
                )
        elif params and params.get("do_remote_decode"):
            if self.config.role.produces:
                request.is_producer = True
            else:
                logger.warning(
                    "Request %s asks to hold KV for a remote decode but this "
                    "engine's role is %s: not holding it.",
                    request.request_id,
                    self.config.role,
                )
        if self.checksums is not None:
            self.checksums.on_new_request(request)
        self._requests[request.request_id] = request
        for alias in (request.request_id, *request.aliases):
            self._aliases.setdefault(alias, []).append(request.request_id)
        self._waiting.append(request)
        self._wake.set()

    def abort(self, ids: Iterable[str]) -> int:
        """Abort requests and drop KV held for remote decodes, by any of their
        ids; returns how many were found."""
        found = 0
        for alias in ids:
            for req_id in list(self._aliases.get(alias, (alias,))):
                if (request := self._requests.get(req_id)) is not None:
                    self._finish(request, FinishReason.ABORT)
                elif req_id in self._leases:
                    self._release(req_id, "aborted")
                else:
                    continue
                found += 1
                self.metrics.requests_aborted.inc()
        return found

    def configure_faults(self, fault: FaultConfig) -> None:
        self.faults.configure(fault)

    # Metrics.

    def held_request_ids(self) -> set[str]:
        """The requests the engine holds anything of: unfinished ones, KV held
        for a remote decode, and checksum state. The workers hear of a
        finished request at the next step; until then theirs does not count.
        Read it while no step runs (an engine at rest)."""
        held = {*self._requests, *self._loading, *self._pulls, *self._leases}
        held.update(req_id for ids in self._aliases.values() for req_id in ids)
        if self.checksums is not None:
            held |= self.checksums.held_request_ids()
        for worker in self.workers:
            if worker.checksums is not None:
                held |= worker.checksums.held_request_ids() - self._finished_req_ids
        return held

    def blocks_held(self) -> int:
        return sum(self.kv.num_blocks(req_id) for req_id in self._leases)

    def snapshot(self) -> EngineSnapshot:
        snap = EngineSnapshot(
            blocks_held=self.blocks_held(),
            requests_running=len(self._running),
            requests_waiting=len(self._waiting) + len(self._loading),
            faults_injected=self.faults.injected,
        )
        if self.checksums is not None:
            snap.checksum_stats = self.checksums.stats
            snap.checksum_bytes = sum(w.checksum_bytes for w in self.workers)
            snap.checksum_seconds = sum(w.checksum_seconds for w in self.workers)
        return snap

    # The step loop.

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            step = self._schedule()
            if step.empty:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            try:
                result = await loop.run_in_executor(self._executor, self._execute, step)
            except Exception:
                logger.exception("Engine step failed.")
                failed = [item.request for item in step.scheduled]
                failed += [
                    r for i in step.finished_loads if (r := self._loading.get(i))
                ]
                for request in failed:
                    self._finish(
                        request, FinishReason.ERROR, error="engine step failed"
                    )
                continue
            # The step's outputs come when its simulated compute is over.
            await self._simulate_compute(step, time.monotonic() - started)
            self._update(step, result)

    async def _simulate_compute(self, step: _Step, elapsed: float) -> None:
        delay = 0.0
        num_prefill = step.num_prefill_tokens()
        if num_prefill and self.config.prefill_tokens_per_s:
            delay += num_prefill / self.config.prefill_tokens_per_s
        decodes = any(
            item.start >= item.request.num_prompt_tokens - 1 for item in step.scheduled
        )
        if decodes and self.config.decode_tokens_per_s:
            delay += 1.0 / self.config.decode_tokens_per_s
        if delay > elapsed:
            await asyncio.sleep(delay - elapsed)

    def _schedule(self) -> _Step:
        """Choose this step's work (vLLM's ``Scheduler.schedule``)."""
        step = _Step(
            finished_loads=self._finished_loads,
            finished_req_ids=self._finished_req_ids,
        )
        self._finished_loads = {}
        self._finished_req_ids = set()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []

        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if count <= 0:
                index += 1
                continue
            while not self.kv.allocate_slots(
                request.request_id, request.num_computed_tokens + count
            ):
                victim = self._running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, count))
                budget -= count
                index += 1

        while self._waiting and budget > 0:
            request = self._waiting[0]
            if request.remote is not None and not request.load_started:
                if not self.kv.allocate_slots(
                    request.request_id, request.num_prompt_tokens
                ):
                    break
                self._waiting.popleft()
                self._start_load(request)
                step.loads_to_start.append(request)
                continue
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(
                request.request_id, request.num_computed_tokens + count
            ):
                break
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            scheduled.append((request, count))
            budget -= count

        for request, count in scheduled:
            step.scheduled.append(self._plan(request, count))
            request.num_computed_tokens += count
            if self.checksums is not None:
                self.checksums.add_send(request, count, self.kv)
        if self.checksums is not None:
            step.checksum_meta = self.checksums.build_checksum_meta()
        return step

    def _plan(self, request: EngineRequest, count: int) -> _Scheduled:
        start = request.num_computed_tokens
        end = start + count
        if len(request.prefix_hashes) < end:
            last = request.prefix_hashes[-1] if request.prefix_hashes else None
            new = [request.token_at(p) for p in range(len(request.prefix_hashes), end)]
            request.prefix_hashes.extend(self.model.prefix_hashes(new, last))
        return _Scheduled(
            request=request,
            start=start,
            end=end,
            write_slots=self.kv.slots(request.request_id, start, end),
            digest_start=request.num_digested,
            digest_slots=self.kv.slots(request.request_id, request.num_digested, end),
            prefix_hashes=request.prefix_hashes[start:end],
            samples=end == request.num_tokens,
            processors=request.sampling.processors_after(request.output_token_ids),
        )

    def _preempt(self, request: EngineRequest) -> None:
        """Free a running request's blocks; it prefills again later."""
        logger.info("Preempting request %s (out of KV blocks).", request.request_id)
        self._running.remove(request)
        self.kv.free(request.request_id)
        self._reset(request)
        self._waiting.appendleft(request)

    @staticmethod
    def _reset(request: EngineRequest) -> None:
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.digest = 0
        request.num_digested = 0

    def _execute(self, step: _Step) -> _StepResult:
        """The workers' part of a step (runs in the engine's thread)."""
        for worker in self.workers:
            worker.begin_step(step.finished_req_ids, step.checksum_meta)
        sampled = self._forward(step.scheduled) if step.scheduled else {}
        for worker in self.workers:
            worker.after_forward()
        loaded = {
            req_id for req_id, load in step.finished_loads.items() if not load.error
        }
        for worker in self.workers:
            worker.on_loads_finished(loaded)
        records = [r for w in self.workers if (r := w.take_record()) is not None]
        return _StepResult(sampled, records)

    def _forward(
        self, items: list[_Scheduled]
    ) -> dict[str, tuple[int, list[TokenLogprob] | None]]:
        """The model's forward over every scheduled request at once: write
        their new tokens' KV, read back the KV each has not read yet, fold
        it into its digest, and choose next tokens."""
        kv = self.model.kv([h for item in items for h in item.prefix_hashes])
        write_slots = torch.cat([item.write_slots for item in items])
        for worker in self.workers:
            worker.write(write_slots, kv)
        read_slots = torch.cat([item.digest_slots for item in items])
        positions = torch.cat(
            [torch.arange(item.digest_start, item.end) for item in items]
        )
        sequences = torch.repeat_interleave(
            torch.arange(len(items)),
            torch.tensor([item.end - item.digest_start for item in items]),
        )
        digests = {}
        for worker in self.workers:
            per_head = self.model.head_digests(worker.read(read_slots), worker.heads)
            for column, head in enumerate(worker.heads.tolist()):
                digests[(head, worker.replica_index)] = per_head[:, column]
        token_digests = self.model.combine_heads(digests, self.config.head_replicas)
        added = self.model.fold(token_digests, positions, sequences, len(items))
        sampled: dict[str, tuple[int, list[TokenLogprob] | None]] = {}
        for item, value in zip(items, added, strict=True):
            request = item.request
            request.digest = (request.digest + value) & MASK64
            request.num_digested = item.end
            if item.samples:
                digest = request.digest ^ request.seed
                token = self.model.next_token(digest, item.end, item.processors)
                logprobs = self._sample_logprobs(
                    request.sampling, digest, item.end, item.processors
                )
                sampled[request.request_id] = token, logprobs
        return sampled

    def _sample_logprobs(
        self,
        sampling: SamplingOptions,
        digest: int,
        position: int,
        processors: Processors,
    ) -> list[TokenLogprob] | None:
        """The logprobs a sampled token comes with, as its request asks:
        those of ``logprob_token_ids`` where set (vLLM's sampler prefers
        them to the top ones), else the top ``logprobs``; None: none."""
        if sampling.logprob_token_ids is not None:
            return self.model.requested_logprobs(
                digest,
                position,
                token_ids=sampling.logprob_token_ids,
                processors=processors,
            )
        if sampling.logprobs is None:
            return None
        return self.model.logprobs(
            digest, position, count=sampling.logprobs, processors=processors
        )

    def _update(self, step: _Step, result: _StepResult) -> None:
        """The scheduler's part after a step (``update_from_output``)."""
        failed: dict[str, str] = {}
        # A step with no checksums reported and no load finished has nothing
        # to verify.
        if self.checksums is not None and (result.records or step.finished_loads):
            output = _ConnectorOutput(result.records, set(step.finished_loads))
            skip = {
                req_id for req_id, load in step.finished_loads.items() if load.error
            }
            self.checksums.update_from_output(output, skip)
            failed = self.checksums.take_load_failures()
            # No prefix cache here: no block of a request serves another, so
            # there is nothing to keep a mismatched load's blocks (or those
            # holding tokens not compared) out of.
            self.checksums.take_mismatched_loads()
            self.checksums.take_uncompared_blocks()
        for req_id, load in step.finished_loads.items():
            request = self._loading.pop(req_id, None)
            if request is None or request.finished:
                continue
            if load.error is not None:
                self._load_failed(request, load.error)
            elif req_id in failed:
                self._load_failed(request, failed[req_id])
            else:
                # The last prompt token is computed again, to sample the next.
                request.num_computed_tokens = request.num_prompt_tokens - 1
                request.status = RequestStatus.WAITING
                self._waiting.appendleft(request)
        for item in step.scheduled:
            request = item.request
            sample = result.sampled.get(request.request_id)
            if request.finished or sample is None:
                continue
            token, token_logprobs = sample
            logprobs = None if token_logprobs is None else [token_logprobs]
            reason, stop_reason = request.append_token(token, self.config.max_model_len)
            if reason is not None:
                self._finish(
                    request,
                    reason,
                    stop_reason=stop_reason,
                    token_ids=[token],
                    logprobs=logprobs,
                )
            else:
                request.outputs.put_nowait(
                    RequestOutput(
                        [token],
                        request.take_text(finished=False),
                        logprobs=logprobs,
                    )
                )
        if self._waiting or self._running or self._finished_loads:
            self._wake.set()

    def _finish(
        self,
        request: EngineRequest,
        reason: FinishReason,
        *,
        stop_reason: int | str | None = None,
        token_ids: list[int] | None = None,
        logprobs: list[list[TokenLogprob]] | None = None,
        error: str | None = None,
    ) -> None:
        """Finish a request: send its KV (a producer), free or hold its
        blocks, and give its last output (``token_ids``, with ``logprobs``)."""
        if request.finished:
            return
        req_id = request.request_id
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._requests.pop(req_id, None)
        if request in self._running:
            self._running.remove(request)
        with contextlib.suppress(ValueError):
            self._waiting.remove(request)
        self._loading.pop(req_id, None)
        if (pull := self._pulls.pop(req_id, None)) is not None:
            pull.cancel()
        params = None
        if request.is_producer and reason in KV_SENT_FINISH_REASONS:
            params = self._producer_params(request)
        if self.checksums is not None:
            self.checksums.request_finished(request, params)
            # Sent in kv_transfer_params only, as NIXL sends them.
            self.checksums.take_kv_checksums_to_send()
        if params is not None:
            self._leases.hold(request)
        else:
            self.kv.free(req_id)
            self._drop_aliases(request)
        self._finished_req_ids.add(req_id)
        self._wake.set()
        request.outputs.put_nowait(
            RequestOutput(
                token_ids or [],
                request.take_text(finished=True),
                finish_reason=FINISH_REASON_TEXT[reason],
                stop_reason=stop_reason,
                error=error,
                kv_transfer_params=params,
                logprobs=logprobs,
            )
        )

    def _drop_aliases(self, request: EngineRequest) -> None:
        for alias in (request.request_id, *request.aliases):
            ids = self._aliases.get(alias)
            if ids is not None and request.request_id in ids:
                ids.remove(request.request_id)
                if not ids:
                    del self._aliases[alias]

    def _producer_params(self, request: EngineRequest) -> dict[str, object]:
        """What NixlConnector's ``request_finished`` returns for a producer
        (pull mode), and the prompt tokens vLLM's scheduler adds that the
        prefill found in its prefix cache (none here: this engine keeps no
        prefix cache), for the decode to report."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [self.kv.block_ids(request.request_id)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.config.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": request.num_computed_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    def _load_failed(self, request: EngineRequest, reason: str) -> None:
        """A consumer's KV load failed: fail the request or prefill locally."""
        self.metrics.load_failures.inc()
        if self.config.kv_load_failure_policy is KVLoadFailurePolicy.FAIL:
            logger.error(
                "KV load failed for request %s: %s", request.request_id, reason
            )
            self._finish(request, FinishReason.ERROR, error=reason)
            return
        logger.warning(
            "KV load failed for request %s (%s): recomputing its prompt.",
            request.request_id,
            reason,
        )
        self._reset(request)
        self._waiting.appendleft(request)

    # Consumer side: pulling KV.

    def _start_load(self, request: EngineRequest) -> None:
        """Start pulling a consumer request's prompt KV into its blocks."""
        request.load_started = True
        request.num_computed_tokens = request.num_prompt_tokens
        if self.checksums is not None:
            self.checksums.add_recv(request, self.kv.get_blocks(request.request_id), 0)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[request.request_id] = request
        self._pulls[request.request_id] = asyncio.create_task(
            self._pull(request), name=f"pull-{request.request_id}"
        )

    async def _pull(self, request: EngineRequest) -> None:
        """The NIXL read's stand-in: fetch the producer's blocks
        (``transfer.KVPuller``), land them, and report the load finished (or
        failed) to the next step. The step that started the load has told the
        workers of it first: the landing queues behind it in the engine's
        thread."""
        req_id = request.request_id
        source = request.remote
        assert source is not None
        fault = self.faults.draw(FaultSide.CONSUMER)
        result = _LoadResult()
        try:
            header, kv = await self._puller.pull(source, self._kv_header("", 0, 0, 0))
            if header.num_tokens < request.num_prompt_tokens:
                raise TransferError(
                    f"the producer holds KV of {header.num_tokens} tokens, "
                    f"the prompt has {request.num_prompt_tokens}"
                )
            await self._delay(fault)
            if self._loading.get(req_id) is not request:
                return
            slots = self.kv.slots(
                req_id, 0, self.kv.num_blocks(req_id) * self.config.block_size
            )
            stale = self.kv.pool.recently_freed(set(self.kv.block_ids(req_id)))
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._land, request, kv, slots, fault, stale
            )
        except (TransferError, OSError) as e:
            result.error = f"KV transfer failed: {e}"
        except Exception as e:
            # Never a load left waiting for ever: it fails, as NIXL's would.
            logger.exception("KV pull for request %s failed.", req_id)
            result.error = f"KV transfer failed: {e.__class__.__name__}: {e}"
        self._pulls.pop(req_id, None)
        if self._loading.get(req_id) is request:
            self._finished_loads[req_id] = result
            self._wake.set()

    async def _delay(self, fault: Fault) -> None:
        if fault.kind is FaultKind.HANG:
            logger.warning("Fault: a KV transfer hangs.")
            await asyncio.Event().wait()
        elif fault.kind is FaultKind.SLOW:
            await asyncio.sleep(self.faults.config.delay_s)

    def _land(
        self,
        request: EngineRequest,
        kv: torch.Tensor,
        slots: torch.Tensor,
        fault: Fault,
        stale_block: int | None,
    ) -> None:
        """Write pulled KV into the request's blocks, whatever the producer's
        block size (runs in the engine's thread)."""
        landed = torch.zeros((len(slots), *kv.shape[1:]), dtype=kv.dtype)
        count = min(len(slots), kv.shape[0])
        landed[:count] = kv[:count]
        if fault.kind.corrupts:
            what = self.faults.corrupt(
                fault,
                landed,
                request.num_prompt_tokens,
                self.config.block_size,
                lambda n: self._stale_kv(stale_block, n),
            )
            logger.warning(
                "Fault on the consumer, request %s: %s.", request.request_id, what
            )
        for worker in self.workers:
            worker.write(slots, landed)

    # Producer side: serving pulls and leases.

    async def serve_pull(self, pull: PullRequest) -> list[bytes | memoryview]:
        """The KV of a held request's blocks, and drop it.

        Raises:
            PullError: If the pull is refused (``Leases.claim``), or the
                KV was dropped while the pull waited.

        """
        block_ids = self.kv.block_ids(pull.request_id)
        held = self._leases.claim(pull, self.engine_id, block_ids)
        wanted = pull.block_ids[0]
        try:
            fault = self.faults.draw(FaultSide.PRODUCER)
            await self._delay(fault)
            self._leases.check_held(held)
            request = held.request
            stale = self.kv.pool.recently_freed(set(block_ids))
            kv = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._gather, request, wanted, fault, stale
            )
            header = self._kv_header(
                request.request_id,
                request.num_computed_tokens,
                len(wanted),
                self.config.block_size,
            )
            self._release(pull.request_id, "pulled")
            return encode_kv(header, kv)
        finally:
            held.pulling = False

    def _kv_header(
        self, request_id: str, num_tokens: int, num_blocks: int, block_size: int
    ) -> KVHeader:
        config = self.config
        return KVHeader(
            version=1,
            engine_id=self.engine_id,
            request_id=request_id,
            num_tokens=num_tokens,
            block_size=block_size or config.block_size,
            num_blocks=num_blocks,
            layers=config.layers,
            heads=config.kv_heads,
            head_size=config.head_size,
            dtype=config.dtype,
        )

    def _read_all_heads(self, slots: torch.Tensor) -> torch.Tensor:
        """KV of all heads (copy 0 of each) in ``slots``."""
        config = self.config
        out = torch.empty(
            (len(slots), config.layers, config.kv_heads, 2, config.head_size),
            dtype=config.cache_dtype,
        )
        for worker in self.workers:
            if worker.replica_index == 0:
                out[:, :, worker.heads] = worker.read(slots)
        return out

    def _gather(
        self,
        request: EngineRequest,
        block_ids: list[int],
        fault: Fault,
        stale_block: int | None,
    ) -> torch.Tensor:
        """The KV of blocks as it goes on the wire (runs in the engine's thread)."""
        block_size = self.config.block_size
        kv = self._read_all_heads(
            token_slots(block_ids, block_size, 0, len(block_ids) * block_size)
        )
        if fault.kind.corrupts:
            what = self.faults.corrupt(
                fault,
                kv,
                request.num_computed_tokens,
                block_size,
                lambda n: self._stale_kv(stale_block, n),
            )
            logger.warning(
                "Fault on the producer, request %s: %s.", request.request_id, what
            )
        return kv

    def _stale_kv(self, block_id: int | None, count: int) -> torch.Tensor:
        """KV of ``count`` tokens of an earlier request: a freed block's, or
        (none freed yet) KV the model computes for other tokens."""
        if block_id is not None:
            block_size = self.config.block_size
            kv = self._read_all_heads(
                token_slots([block_id], block_size, 0, block_size)
            )
            if count <= block_size:
                return kv[:count]
        tokens = (b"an earlier request; " * (count // 20 + 1))[:count]
        return self.model.kv(self.model.prefix_hashes(tokens, None))

    def _release(self, req_id: str, why: str) -> None:
        """Drop KV held for a remote decode."""
        held = self._leases.drop(req_id)
        if held is None:
            return
        count = self.kv.free(req_id)
        self._drop_aliases(held.request)
        # Requests may be waiting for these blocks.
        self._wake.set()
        logger.debug("Released %d KV blocks of request %s: %s.", count, req_id, why)

    async def _lease_loop(self) -> None:
        await self._leases.expire(self._lease_expired)

    def _lease_expired(self, req_id: str) -> None:
        logger.warning(
            "The lease of request %s's KV expired before its consumer pulled it.",
            req_id,
        )
        self._release(req_id, "lease expired")
