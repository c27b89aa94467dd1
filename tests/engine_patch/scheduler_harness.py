"""Drivers of KVChecksumScheduler for tests without torch: a producer and a
consumer engine's scheduler with stand-in workers (``kv_host_fakes``), one
request at a time, and the small configs they take."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from kv_host_fakes import (
    FakeBlocks,
    FakeConnector,
    FakeConnectorOutput,
    FakeKVCacheManager,
    FakeRequest,
    FakeWorkers,
    consumer_request,
    producer_request,
    scheduled_values,
    token_values,
)

from engine_patch.config import KVChecksumConfig
from engine_patch.host import FinishReason
from engine_patch.kv_cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
    sliding_window_transfer_blocks,
)
from engine_patch.payload import KV_TRANSFER_PARAMS_KEY
from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.stats import KVChecksumStats
from engine_patch.verify import (
    UnverifiedReason,
)

R = UnverifiedReason


def kv_config(*specs: KVCacheSpec, hash_block_size: int | None = None) -> KVCacheConfig:
    return KVCacheConfig(
        [KVCacheGroup(spec) for spec in specs], hash_block_size=hash_block_size
    )


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size)


def make_scheduler(
    config: KVCacheConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    fail_closed: bool = True,
    connector: FakeConnector | None = None,
) -> KVChecksumScheduler:
    return KVChecksumScheduler(
        KVChecksumConfig(tp_size=tp, pp_size=pp, fail_closed=fail_closed),
        config,
        connector or FakeConnector(),
    )


@dataclass
class Producer:
    """A producer engine's scheduler and workers, one request at a time."""

    config: KVCacheConfig
    workers: FakeWorkers = field(default_factory=FakeWorkers)

    def __post_init__(self) -> None:
        self.scheduler = make_scheduler(
            self.config, tp=self.workers.tp, pp=self.workers.pp
        )
        self.manager = FakeKVCacheManager()

    def prefill(
        self,
        req: FakeRequest,
        blocks: FakeBlocks,
        tokens: Mapping[int, np.ndarray],
        num_scheduled: int | None = None,
    ) -> None:
        """Schedule the step that finishes the prompt; the workers report."""
        self.manager.by_request[req.request_id] = blocks
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.add_send(
            req, num_scheduled or req.num_prompt_tokens, self.manager
        )
        scheduled = self.scheduler.build_checksum_meta()
        assert scheduled is not None
        values = scheduled_values(
            scheduled.reqs_to_send[req.request_id], tokens, self.config
        )
        records = self.workers.report(req.request_id, values)
        assert not self.scheduler.update_from_output(
            FakeConnectorOutput(records), set()
        )

    def finish(
        self, req: FakeRequest, reason: FinishReason = FinishReason.STOP
    ) -> str | None:
        req.finish_reason = reason
        params: dict[str, object] = {}
        self.scheduler.request_finished(req, params)
        encoded = params.get(KV_TRANSFER_PARAMS_KEY)
        assert encoded is None or isinstance(encoded, str)
        return encoded

    def send(
        self, num_tokens: int, blocks: FakeBlocks, tokens: Mapping[int, np.ndarray]
    ) -> str:
        """A whole producer request: its encoded payload."""
        req = producer_request("req", num_tokens)
        self.prefill(req, blocks, tokens)
        encoded = self.finish(req)
        assert encoded is not None
        return encoded


@dataclass
class Consumer:
    """A consumer engine's scheduler and workers."""

    config: KVCacheConfig
    workers: FakeWorkers = field(default_factory=FakeWorkers)
    fail_closed: bool = True
    connector: FakeConnector = field(default_factory=FakeConnector)
    # The failed loads of the last ``load``, where a helper keeps them.
    failed: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.scheduler = make_scheduler(
            self.config,
            tp=self.workers.tp,
            pp=self.workers.pp,
            fail_closed=self.fail_closed,
            connector=self.connector,
        )

    def start_load(
        self, req: FakeRequest, blocks: FakeBlocks, num_local_tokens: int = 0
    ) -> None:
        self.scheduler.on_new_request(req)
        req.num_computed_tokens = req.num_prompt_tokens
        self.scheduler.add_recv(req, blocks, num_local_tokens)

    def load(
        self,
        req: FakeRequest,
        blocks: FakeBlocks,
        tokens: Mapping[int, np.ndarray],
        *,
        num_local_tokens: int = 0,
        received: bytes | None = None,
        ranks: list[tuple[int, int]] | None = None,
    ) -> set[str]:
        """Load the request's KV (``tokens``: what the blocks hold after it),
        the workers report, and the load finishes: the failed loads."""
        self.start_load(req, blocks, num_local_tokens)
        scheduled = self.scheduler.build_checksum_meta()
        assert scheduled is not None
        values = scheduled_values(
            scheduled.reqs_to_recv[req.request_id], tokens, self.config
        )
        records = self.workers.report(req.request_id, values, ranks=ranks)
        if received is not None:
            records[0].received[req.request_id] = received
        return self.scheduler.update_from_output(
            FakeConnectorOutput(records, {req.request_id}), set()
        )

    @property
    def stats(self) -> KVChecksumStats:
        return self.scheduler.stats


def corrupt(tokens: np.ndarray, token: int) -> np.ndarray:
    bad = tokens.copy()
    bad[token] ^= np.uint64(1 << 63)
    return bad


RNG = np.random.default_rng(1234)


def window_blocks(
    spec: SlidingWindowSpec, num_tokens: int, first_id: int
) -> list[int | None]:
    """A sliding-window group's blocks: null out of the window, then the
    ones P/D connectors transfer."""
    count = -(-num_tokens // spec.block_size)
    keep = min(count, sliding_window_transfer_blocks(spec))
    return [None] * (count - keep) + list(range(first_id, first_id + keep))


def load_with_payload(
    params: dict[str, object] | None,
    *,
    fail_closed: bool = True,
    consumer_config: KVCacheConfig | None = None,
    consumer_workers: FakeWorkers | None = None,
    consumer_blocks: FakeBlocks | None = None,
    num_tokens: int = 40,
    num_local_tokens: int = 0,
    ranks: list[tuple[int, int]] | None = None,
) -> Consumer:
    """A consumer's load of 40 tokens (by default) whose request has
    ``params`` for its kv_transfer_params; its failed loads in ``failed``."""
    consumer = Consumer(
        consumer_config or kv_config(full()),
        consumer_workers or FakeWorkers(),
        fail_closed=fail_closed,
    )
    req = consumer_request("c", num_tokens, params)
    consumer.failed = consumer.load(
        req,
        consumer_blocks or FakeBlocks.of([1, 2, 3]),
        {0: token_values(RNG, num_tokens), 1: token_values(RNG, num_tokens)},
        num_local_tokens=num_local_tokens,
        ranks=ranks,
    )
    return consumer
