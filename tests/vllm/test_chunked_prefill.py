"""A producer prompt prefilled over several steps (chunked prefill): the
step finishing it checksums the request's blocks as vLLM's KV cache manager
holds them, read from the block ids vLLM's scheduler output lists for its
workers step by step, not from one block object per block.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_steps import (
    BLOCK_SIZE,
    LAYERS,
    Workers,
    block_checksums,
    kvguard_counts,
    kvguard_metadata,
    make_scheduler,
    request,
    runner_output,
    vllm_config,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

import engine_patch.scheduler
from engine_patch.vllm.metadata import KVGuardConnectorMetadata
from engine_patch.vllm.prefill_ids import PrefillBlockIds, StepBlockIds
from engine_patch.vllm.scheduler import KVGuardScheduler

pytestmark = pytest.mark.vllm

# Six blocks of prompt, two blocks per step: three steps.
NUM_TOKENS = 6 * BLOCK_SIZE - 5
STEP_TOKENS = 2 * BLOCK_SIZE


@pytest.fixture
def scheduler() -> Scheduler:
    config = vllm_config("kv_producer")
    config.scheduler_config.max_num_batched_tokens = STEP_TOKENS
    return make_scheduler(KVGuardScheduler, config)


@pytest.fixture
def ids_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the checksum scheduler reads each group's block ids from:
    'ids' (a list of ints) or 'blocks' (vLLM's block objects)."""
    read: list[str] = []
    ids_of = engine_patch.scheduler._ids_of

    def spy(blocks: Any, start: int, end: int | None) -> list[int]:
        read.append("ids" if blocks and isinstance(blocks[0], int) else "blocks")
        return ids_of(blocks, start, end)

    monkeypatch.setattr(engine_patch.scheduler, "_ids_of", spy)
    return read


def prefill(
    scheduler: Scheduler, req_id: str
) -> tuple[list[SchedulerOutput], dict[str, Any]]:
    """Add a producer request and run its steps until one sends its
    checksums to the workers, who report them; the steps' scheduler outputs,
    and KVGuard's counts of that step."""
    scheduler.add_request(
        request(req_id, NUM_TOKENS, {"do_remote_decode": True}, max_tokens=1)
    )
    outputs: list[SchedulerOutput] = []
    while len(outputs) < 10:
        output = scheduler.schedule()
        outputs.append(output)
        # Steps with nothing of KVGuard's carry the inner connector's alone.
        meta = output.kv_connector_metadata
        checksums = (
            meta.checksums if isinstance(meta, KVGuardConnectorMetadata) else None
        )
        sends = checksums.reqs_to_send if checksums else {}
        workers = Workers(checksums={r: block_checksums(NUM_TOKENS) for r in sends})
        prefilling = {
            r
            for r in output.num_scheduled_tokens
            if scheduler.requests[r].num_computed_tokens < NUM_TOKENS
        }
        engine_outputs = scheduler.update_from_output(
            output, runner_output(output, workers.connector_output(), prefilling)
        )
        if req_id in sends:
            return outputs, kvguard_counts(engine_outputs)
    raise AssertionError(f"{req_id}'s checksums never went to the workers")


def test_a_chunked_prompt_is_checksummed_over_the_blocks_it_holds(
    scheduler: Scheduler, ids_read: list[str]
) -> None:
    outputs, counts = prefill(scheduler, "p")
    held = scheduler.kv_cache_manager.get_block_ids("p")
    sent = kvguard_metadata(outputs[-1]).checksums.reqs_to_send["p"]  # type: ignore[union-attr]
    assert len(outputs) == 3
    assert (sent.num_tokens, sent.groups) == (NUM_TOKENS, {0: (0, list(held[0]))})
    assert counts.get("sent") == 1
    # From the ids the three steps listed for the workers.
    assert ids_read == ["ids"]


def test_two_chunked_prompts_in_turn_keep_their_own_blocks(
    scheduler: Scheduler,
) -> None:
    first, _ = prefill(scheduler, "a")
    second, counts = prefill(scheduler, "b")
    for req_id, outputs in (("a", first), ("b", second)):
        sent = kvguard_metadata(outputs[-1]).checksums.reqs_to_send[req_id]  # type: ignore[union-attr]
        held = scheduler.kv_cache_manager.get_block_ids(req_id)
        assert sent.groups == {0: (0, list(held[0]))}
    assert counts.get("sent") == 1


def kv_cache_config(*specs: Any) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec) for spec in specs],
    )


FULL = FullAttentionSpec(
    block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
)
SLIDING = SlidingWindowSpec(
    block_size=BLOCK_SIZE,
    num_kv_heads=2,
    head_size=32,
    dtype=torch.bfloat16,
    sliding_window=64,
)


def step_ids(
    new: dict[str, tuple[list[int], ...]] | None = None,
    cached: dict[str, tuple[list[int], ...] | None] | None = None,
    resumed: frozenset[str] = frozenset(),
) -> StepBlockIds:
    """A step's ids as a scheduler output lists them."""
    new, cached = new or {}, cached or {}
    return StepBlockIds(
        SimpleNamespace(  # type: ignore[arg-type]
            scheduled_new_reqs=[
                SimpleNamespace(req_id=r, block_ids=ids) for r, ids in new.items()
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=list(cached),
                resumed_req_ids=set(resumed),
                new_block_ids=list(cached.values()),
            ),
        )
    )


def test_ids_are_kept_only_where_blocks_never_leave_a_request() -> None:
    assert PrefillBlockIds(kv_cache_config(FULL, FULL)).enabled
    assert not PrefillBlockIds(kv_cache_config(FULL, SLIDING)).enabled


def test_each_steps_new_ids_are_appended_until_the_prompt_finishes() -> None:
    ids = PrefillBlockIds(kv_cache_config(FULL))
    first = ([1, 2],)
    assert ids.step(step_ids(new={"r": first}), "r", 0, 64, 150) is None
    # vLLM's worker, in process, extends the very lists it was given.
    first[0].append(99)
    assert ids.step(step_ids(cached={"r": ([3, 4],)}), "r", 64, 64, 150) is None
    assert ids.step(step_ids(cached={"r": None}), "r", 128, 10, 150) is None
    assert ids.step(step_ids(cached={"r": ([5],)}), "r", 138, 12, 150) == (
        [1, 2, 3, 4, 5],
    )
    # Decoding from here: nothing kept.
    assert ids.step(step_ids(cached={"r": ([6],)}), "r", 150, 1, 150) is None
    assert ids.step(step_ids(cached={"r": None}), "r", 140, 10, 150) is None


def test_a_resumed_request_starts_again_from_all_its_ids() -> None:
    ids = PrefillBlockIds(kv_cache_config(FULL))
    ids.step(step_ids(new={"r": ([1, 2],)}), "r", 0, 64, 150)
    # Preempted, then resumed with other blocks.
    resumed = step_ids(cached={"r": ([7, 8],)}, resumed=frozenset({"r"}))
    assert ids.step(resumed, "r", 0, 64, 150) is None
    assert ids.step(step_ids(cached={"r": ([9, 10],)}), "r", 64, 86, 150) == (
        [7, 8, 9, 10],
    )


def test_a_request_first_seen_mid_prompt_reads_its_blocks() -> None:
    ids = PrefillBlockIds(kv_cache_config(FULL))
    assert ids.step(step_ids(cached={"r": ([3],)}), "r", 64, 86, 150) is None
    # Not listed in a step it was scheduled in: what it holds is unknown.
    ids.step(step_ids(new={"s": ([1],)}), "s", 0, 32, 150)
    assert ids.step(step_ids(), "s", 32, 118, 150) is None
    ids.discard("s")
