"""Fail-open in vLLM 0.32's real scheduler (stepped in process, no workers):
a load that mismatches its checksums decodes, but no other request ever
finds its blocks in vLLM's prefix cache, nor the blocks it computes from
them; a clean load's blocks serve later requests as vLLM's own do, except
blocks holding tokens that were not compared (in both modes).

Loads are of 100 tokens (4 blocks of 32, the last one partial) or of 20
(inside one block: the first full block is one the request decodes into).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from engine_steps import (
    BLOCK_SIZE,
    Workers,
    block_checksums,
    cached_tokens,
    consumer_params,
    kvguard_counts,
    make_scheduler,
    request,
    step,
    vllm_config,
)
from vllm.v1.core.sched.scheduler import Scheduler

from engine_patch.scheduler import KVChecksumScheduler
from engine_patch.vllm.prefix_cache import keep_out_of_prefix_cache
from engine_patch.vllm.scheduler import KVGuardScheduler

pytestmark = pytest.mark.vllm

# Enough tokens decoded to fill the load's last block and one more.
MAX_TOKENS = 2 * BLOCK_SIZE
MODES = {"scheduler-class": KVGuardScheduler, "connector-only": Scheduler}


@pytest.fixture(params=list(MODES))
def scheduler(request: pytest.FixtureRequest) -> Scheduler:
    """A fail-open consumer in each of KVGuard's modes."""
    config = vllm_config("kv_consumer", fail_closed=False)
    return make_scheduler(MODES[request.param], config)


def run_load(scheduler: Scheduler, num_tokens: int, corrupt: bool) -> list[int]:
    """A consumer request's life from its load (corrupted or not) to its
    last token; its prompt and output tokens.

    Raises:
        AssertionError: If KVGuard's verdict is not the expected one.
    """
    checksums = block_checksums(num_tokens)
    scheduler.add_request(
        request(
            "loaded",
            num_tokens,
            consumer_params(num_tokens, checksums),
            max_tokens=MAX_TOKENS,
        )
    )
    loaded = scheduler.requests["loaded"]
    step(scheduler)
    values = checksums.copy()
    if corrupt:
        values[-1] ^= np.uint64(1 << 40)
    _, outputs = step(
        scheduler,
        Workers(finished_recving={"loaded"}, checksums={"loaded": values}),
    )
    counts = kvguard_counts(outputs)
    assert counts.get("mismatch", 0) == int(corrupt), counts
    assert counts.get("verified", 0) == int(not corrupt), counts
    while "loaded" in scheduler.requests:
        step(scheduler)
    # Fail-open: the request decoded all its tokens, whatever the verdict.
    assert len(loaded.output_token_ids) == MAX_TOKENS
    return list(loaded.all_token_ids)


def full_blocks(num_tokens: int) -> int:
    """The tokens of the full blocks a request of ``num_tokens`` can hit
    (never its last token)."""
    return (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.parametrize("num_tokens", [100, 20])
def test_fail_open_a_mismatched_loads_blocks_are_never_found_by_another_request(
    scheduler: Scheduler, num_tokens: int
) -> None:
    tokens = run_load(scheduler, num_tokens, corrupt=True)
    # The same prompt, and the prompt with the request's output (blocks it
    # computed from the loaded ones): nothing of it is served from cache.
    assert cached_tokens(scheduler, tokens[:num_tokens]) == 0
    assert cached_tokens(scheduler, tokens) == 0


@pytest.mark.parametrize("num_tokens", [100, 20])
def test_fail_open_a_clean_loads_blocks_serve_later_requests(
    scheduler: Scheduler, num_tokens: int
) -> None:
    tokens = run_load(scheduler, num_tokens, corrupt=False)
    assert cached_tokens(scheduler, tokens[:num_tokens]) == full_blocks(num_tokens)
    assert cached_tokens(scheduler, tokens) == full_blocks(len(tokens))


@pytest.mark.parametrize("fail_closed", [True, False], ids=["fail-closed", "fail-open"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_verified_loads_blocks_holding_tokens_not_compared_serve_no_other_request(
    mode: str, fail_closed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = make_scheduler(
        MODES[mode], vllm_config("kv_consumer", fail_closed=fail_closed)
    )
    # The model here has no sliding-window group, whose loads can hold such
    # tokens (tests/engine_patch: the comparer names their blocks); the
    # verdict names the load's second block, as it would there.
    unsent = (BLOCK_SIZE, 2 * BLOCK_SIZE)
    monkeypatch.setattr(
        KVChecksumScheduler,
        "take_uncompared_blocks",
        lambda self: {"loaded": [unsent]},
    )
    tokens = run_load(scheduler, 100, corrupt=False)
    # The first block still serves the prompt; the named one, and so every
    # full-attention block after it, does not.
    assert cached_tokens(scheduler, tokens[:100]) == BLOCK_SIZE
    assert cached_tokens(scheduler, tokens) == BLOCK_SIZE


def test_blocks_hashed_later_from_the_first_loaded_one_on_get_random_hashes() -> None:
    # Two full blocks hashed, the load from token 96 (block 3): the hasher's
    # next call makes blocks 2-4 at once (several tokens in one step).
    hashes = [bytes([i]) * 32 for i in range(5)]
    req = SimpleNamespace(block_hashes=hashes[:2], _block_hasher=None)
    req._block_hasher = lambda r: hashes[len(r.block_hashes) :]
    keep_out_of_prefix_cache(req, 96, BLOCK_SIZE)  # type: ignore[arg-type]
    new = req._block_hasher(req)
    assert req.block_hashes == hashes[:2]
    assert new[0] == hashes[2]
    assert new[1] != hashes[3] and new[2] != hashes[4]
