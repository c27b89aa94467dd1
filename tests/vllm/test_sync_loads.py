"""Loads an inner connector makes synchronously, inside the forward that uses
the KV (vLLM's ExampleConnector here): no verdict can come before the KV is
used, so KVGuard cannot verify them. Fail-closed it refuses a consumer's such
load from its producer (vLLM computes the prompt); fail-open it lets it go
ahead; both count it unverified. vLLM 0.32's real scheduler, stepped in
process (``engine_steps``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_steps import (
    BLOCK_SIZE,
    block_checksums,
    consumer_params,
    kvguard_counts,
    make_scheduler,
    request,
    step,
    vllm_config,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from engine_patch.verify import UnverifiedReason
from engine_patch.vllm.connector import KVGuardConnector
from engine_patch.vllm.scheduler import KVGuardScheduler

pytestmark = pytest.mark.vllm

NUM_TOKENS = 100
# ExampleConnector loads the prompt's whole blocks but its last token.
LOADED = (NUM_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE


def example_scheduler(
    tmp_path: Path, cls: type[Scheduler], *, fail_closed: bool = True
) -> Scheduler:
    """A consumer with KVGuard around vLLM's ExampleConnector, which loads a
    prompt stored under ``tmp_path`` synchronously."""
    inner = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    config = vllm_config("kv_consumer", fail_closed=fail_closed, inner=inner)
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


@pytest.mark.parametrize("cls", [KVGuardScheduler, Scheduler])
def test_a_consumers_sync_load_is_refused_fail_closed_and_its_prompt_computed(
    tmp_path: Path, cls: type[Scheduler]
) -> None:
    scheduler = example_scheduler(tmp_path, cls)
    scheduler.add_request(consumer(scheduler))
    output, engine_outputs = step(scheduler)
    # The whole prompt is computed here: nothing was loaded unchecked.
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS}
    assert sync_load_counts(engine_outputs) == 1


def test_fail_open_a_consumers_sync_load_goes_ahead_counted_unverified(
    tmp_path: Path,
) -> None:
    scheduler = example_scheduler(tmp_path, KVGuardScheduler, fail_closed=False)
    scheduler.add_request(consumer(scheduler))
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS - LOADED}
    assert sync_load_counts(engine_outputs) == 1


def test_a_sync_load_of_a_request_of_no_pd_pair_is_not_refused(
    tmp_path: Path,
) -> None:
    """Its engine's own cache tier, which KVGuard does not check (as a local
    prefix cache hit)."""
    scheduler = example_scheduler(tmp_path, KVGuardScheduler)
    scheduler.add_request(stored(scheduler, request("r1", NUM_TOKENS, None)))
    output, engine_outputs = step(scheduler)
    assert output.num_scheduled_tokens == {"r1": NUM_TOKENS - LOADED}
    assert sync_load_counts(engine_outputs) == 0
