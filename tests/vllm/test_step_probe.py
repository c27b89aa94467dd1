"""The benchmark's step probe (step_probe.py) in vLLM's real scheduler: it
counts the engine steps from a load's finish to its first token: one with
vLLM's scheduler or KVGuard's, two when KVGuard's workers hold the load
for its verdict."""

from __future__ import annotations

import logging
import re

import pytest
from engine_steps import (
    Workers,
    block_checksums,
    consumer_params,
    make_scheduler,
    request,
    step,
    vllm_config,
)
from step_probe import StepProbeKVGuardScheduler, StepProbeScheduler
from vllm.v1.core.sched.scheduler import Scheduler

pytestmark = pytest.mark.vllm

NUM_TOKENS = 100
CHECKSUMS = block_checksums(NUM_TOKENS)


def load(scheduler: Scheduler, hold: bool) -> None:
    scheduler.add_request(
        request("r1", NUM_TOKENS, consumer_params(NUM_TOKENS, CHECKSUMS))
    )
    step(scheduler)
    if hold:
        step(scheduler, Workers(held={"r1"}, checksums={"r1": CHECKSUMS}))
        step(scheduler, Workers(finished_recving={"r1"}, kvguard=False))
    else:
        step(scheduler, Workers(finished_recving={"r1"}, checksums={"r1": CHECKSUMS}))
    step(scheduler)


@pytest.mark.parametrize(
    ("cls", "hold", "steps"),
    [(StepProbeKVGuardScheduler, False, 1), (StepProbeScheduler, True, 2)],
)
def test_the_probe_counts_steps_from_a_loads_finish_to_its_first_token(
    cls: type[Scheduler], hold: bool, steps: int
) -> None:
    scheduler = make_scheduler(cls, vllm_config("kv_consumer"))
    records = _Records()
    logger = logging.getLogger("vllm.kvguard_step_probe")
    level = logger.level
    logger.addHandler(records)
    # vLLM's logging is configured in its engine processes only.
    logger.setLevel(logging.INFO)
    try:
        load(scheduler, hold)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    counts = [int(n) for m in records.messages for n in re.findall(r"(\d+) steps", m)]
    assert counts == [steps]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
