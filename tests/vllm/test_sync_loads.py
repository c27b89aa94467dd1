"""Loads an inner connector makes synchronously, inside the forward that uses
the KV (vLLM's ExampleConnector here). With KVGuard's scheduler class the
workers checksum such a load after the forward and the scheduler verifies it
in that step's ``update_from_output``: a failed one becomes invalid blocks,
which vLLM recomputes or fails by its ``kv_load_failure_policy`` before the
step's token is used. Connector-only, no verdict can come in time: a
consumer's such load from its producer is refused fail-closed (vLLM computes
the prompt), and goes ahead fail-open, counted unverified. vLLM 0.32's real
scheduler, stepped in process (``engine_steps``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_steps import (
    BLOCK_SIZE,
    Workers,
    block_checksums,
    cached_tokens,
    consumer_params,
    finished,
    kvguard_counts,
    make_scheduler,
    request,
    runner_output,
    step,
    vllm_config,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request

from engine_patch.verify import UnverifiedReason
from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.metadata import KVGuardConnectorMetadata
from engine_patch.vllm.scheduler import KVGuardAsyncScheduler, KVGuardScheduler

pytestmark = pytest.mark.vllm

NUM_TOKENS = 100
# ExampleConnector loads the prompt's whole blocks but its last token.
LOADED = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE


def example_scheduler(
    tmp_path: Path,
    cls: type[Scheduler],
    *,
    fail_closed: bool = True,
    checksums: bool = True,
    policy: str = "fail",
) -> Scheduler:
    """A consumer with KVGuard around vLLM's ExampleConnector, which loads a
    prompt stored under ``tmp_path`` synchronously."""
    inner = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    config = vllm_config(
        "kv_consumer",
        fail_closed=fail_closed,
        checksums=checksums,
        policy=policy,
        inner=inner,
    )
    return make_scheduler(cls, config)


def stored(scheduler: Scheduler, req: Request) -> Request:
    """``req`` with its prompt's KV in the ExampleConnector's storage, as its
    producer would have saved it."""
    connector = scheduler.connector
    assert isinstance(connector, KVGuardConnector)
    tokens = torch.tensor(req.prompt_token_ids)[:LOADED]
    connector.inner._generate_foldername_debug(  # type: ignore[attr-defined]
        tokens, [], create_folder=True
    )
    return req


def consumer(scheduler: Scheduler, req_id: str = "r1") -> Request:
    params = consumer_params(NUM_TOKENS, block_checksums(NUM_TOKENS))
    return stored(scheduler, request(req_id, NUM_TOKENS, params))


def sync_load_counts(engine_outputs: Any) -> int:
    unverified = kvguard_counts(engine_outputs).get("unverified", {})
    return int(unverified.get(str(UnverifiedReason.SYNC_LOAD), 0))


# What the workers checksum of the loaded blocks: the producer's values.
LOADED_CHECKSUMS = block_checksums(LOADED)


def corrupted() -> np.ndarray:
    values = LOADED_CHECKSUMS.copy()
    values[1] ^= np.uint64(1 << 7)
    return values


def new_tokens(engine_outputs: Any) -> list[list[int]]:
    return [
        o.new_token_ids
        for eco in engine_outputs.values()
        for o in eco.outputs
        if o.new_token_ids
    ]


@pytest.mark.parametrize("cls", [KVGuardScheduler, KVGuardAsyncScheduler])
def test_with_the_scheduler_class_a_clean_sync_load_verifies_in_its_step(
    tmp_path: Path, cls: type[Scheduler]
) -> None:
    scheduler = example_scheduler(tmp_path, cls)
    scheduler.add_request(consumer(scheduler))
    workers = Workers(checksums={"r1": LOADED_CHECKSUMS})
    output, engine_outputs = step(scheduler, workers)
    # Loaded in this step's forward, which computes the rest of the prompt.
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS - LOADED}
    meta = output.kv_connector_metadata
    assert isinstance(meta, KVGuardConnectorMetadata) and meta.sync_loads == ["r1"]
    assert kvguard_counts(engine_outputs)["verified"] == 1
    assert not finished(engine_outputs)
    assert new_tokens(engine_outputs)


def test_with_the_scheduler_class_a_corrupted_sync_load_fails_in_its_step(
    tmp_path: Path,
) -> None:
    scheduler = example_scheduler(tmp_path, KVGuardScheduler)
    scheduler.add_request(consumer(scheduler))
    _, engine_outputs = step(scheduler, Workers(checksums={"r1": corrupted()}))
    # kv_load_failure_policy "fail": the request ends with an error, and the
    # token the bad KV gave is never sent.
    assert finished(engine_outputs) == {"r1": FinishReason.ERROR}
    assert not new_tokens(engine_outputs)
    counts = kvguard_counts(engine_outputs)
    assert counts["mismatch"] == 1
    assert "KV checksum mismatch" in counts["failed_requests"]["r1"]


def test_with_the_scheduler_class_recompute_computes_a_corrupted_sync_load_again(
    tmp_path: Path,
) -> None:
    scheduler = example_scheduler(tmp_path, KVGuardScheduler, policy="recompute")
    scheduler.add_request(consumer(scheduler))
    _, engine_outputs = step(scheduler, Workers(checksums={"r1": corrupted()}))
    assert not finished(engine_outputs)
    assert not new_tokens(engine_outputs)
    output, _ = step(scheduler)
    # Nothing of the bad load is kept: the prompt is computed locally.
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS}


@pytest.mark.parametrize("workers_sent", ["no report", "no output"])
def test_a_sync_load_its_workers_did_not_checksum_fails(
    tmp_path: Path, workers_sent: str
) -> None:
    scheduler = example_scheduler(tmp_path, KVGuardScheduler)
    scheduler.add_request(consumer(scheduler))
    if workers_sent == "no report":
        _, engine_outputs = step(scheduler, Workers(kvguard=False))
    else:
        # vLLM passes no connector output for a step with nothing in it.
        output = scheduler.schedule()
        engine_outputs = scheduler.update_from_output(
            output, runner_output(output, None)
        )
    assert finished(engine_outputs) == {"r1": FinishReason.ERROR}
    assert kvguard_counts(engine_outputs)["unverified"]


def test_connector_only_a_consumers_sync_load_is_refused_fail_closed(
    tmp_path: Path,
) -> None:
    scheduler = example_scheduler(tmp_path, Scheduler)
    scheduler.add_request(consumer(scheduler))
    output, engine_outputs = step(scheduler)
    # The whole prompt is computed here: without the scheduler class the
    # step's token would come before any verdict on the load.
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS}
    assert sync_load_counts(engine_outputs) == 1


def test_connector_only_fail_open_a_sync_load_goes_ahead_counted_unverified(
    tmp_path: Path,
) -> None:
    scheduler = example_scheduler(tmp_path, Scheduler, fail_closed=False)
    scheduler.add_request(consumer(scheduler))
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS - LOADED}
    assert sync_load_counts(engine_outputs) == 1


@pytest.mark.parametrize("cls", [KVGuardScheduler, Scheduler])
def test_a_sync_load_of_a_request_of_no_pd_pair_is_not_checked(
    tmp_path: Path, cls: type[Scheduler]
) -> None:
    """Its engine's own cache tier, which KVGuard does not check (as a local
    prefix cache hit)."""
    scheduler = example_scheduler(tmp_path, cls)
    scheduler.add_request(stored(scheduler, request("r1", NUM_TOKENS, None)))
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS - LOADED}
    assert not kvguard_counts(engine_outputs)
    assert new_tokens(engine_outputs)


@pytest.mark.parametrize("cls", [KVGuardScheduler, Scheduler])
def test_with_checksums_off_a_sync_load_goes_ahead_unchecked(
    tmp_path: Path, cls: type[Scheduler]
) -> None:
    scheduler = example_scheduler(tmp_path, cls, checksums=False)
    scheduler.add_request(consumer(scheduler))
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS - LOADED}
    assert not kvguard_counts(engine_outputs)
    assert new_tokens(engine_outputs)


@pytest.mark.parametrize("corrupt", [False, True], ids=["clean", "corrupted"])
def test_fail_open_a_mismatched_sync_loads_blocks_leave_the_prefix_cache(
    tmp_path: Path, corrupt: bool
) -> None:
    """vLLM cached the blocks when it allocated them, before the load."""
    scheduler = example_scheduler(tmp_path, KVGuardScheduler, fail_closed=False)
    req = consumer(scheduler)
    scheduler.add_request(req)
    loaded = corrupted() if corrupt else LOADED_CHECKSUMS
    _, engine_outputs = step(scheduler, Workers(checksums={"r1": loaded}))
    assert kvguard_counts(engine_outputs)["mismatch"] == int(corrupt)
    assert new_tokens(engine_outputs)  # fail-open: the request goes on
    hit = cached_tokens(scheduler, list(req.prompt_token_ids))
    assert hit == (0 if corrupt else LOADED)
