"""KVGuard's vLLM scheduler classes: each finished KV load is verified in the
``update_from_output`` that reports it (same-step verdicts), so no load
waits an engine step for its verdict as it does with the connector alone.

Load one with vLLM's ``--scheduler-cls``, beside ``KVGuardConnector``::

    --scheduler-cls engine_patch.vllm.scheduler.KVGuardScheduler
    --scheduler-cls engine_patch.vllm.scheduler.KVGuardAsyncScheduler  # async

vLLM's ``update_from_output`` reads a step's failed loads
(``failed_recving``) before anything else and its worker metadata, where
KVGuard's checksums travel, only at the end (``update_connector_output``).
These classes verify the step's finished loads against those checksums
first, so that a load failing verification is a failed load of that very
step, to which vLLM applies its ``kv_load_failure_policy``; a load that
verifies is schedulable in the next step, as without KVGuard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

from engine_patch.log import get_logger
from engine_patch.vllm._logging import use_vllm_handlers
from engine_patch.vllm.connector import SAME_STEP_VERDICTS_ATTR, KVGuardConnector

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput

logger = get_logger(__name__)


class _SameStepVerdicts(Scheduler):
    """Verifies each step's finished KV loads before vLLM reads them.

    Without a KVGuardConnector (directly, not inside another connector) it
    schedules as its base class does, with a warning.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        use_vllm_handlers()
        self._kvguard: KVGuardConnector | None = None
        if isinstance(self.connector, KVGuardConnector):
            self._kvguard = self.connector
            self._kvguard.use_same_step_verdicts()
        else:
            logger.warning(
                "%s has no KVGuardConnector to verify KV loads with (the KV "
                "connector is %s): it schedules as vLLM's own.",
                type(self).__name__,
                type(self.connector).__name__ if self.connector else "not set",
            )

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        if self._kvguard is not None:
            output = model_runner_output.kv_connector_output
            if output is None and self._kvguard.sync_loads(scheduler_output):
                # The workers sent nothing, yet the step's forward loaded KV:
                # its verdict (unverified) needs an output to go into.
                output = model_runner_output.kv_connector_output = KVConnectorOutput()
            if output is not None:
                self._kvguard.verify_finished_loads(output, scheduler_output)
        return super().update_from_output(scheduler_output, model_runner_output)


setattr(_SameStepVerdicts, SAME_STEP_VERDICTS_ATTR, True)


class KVGuardScheduler(_SameStepVerdicts):
    """vLLM's ``Scheduler`` with same-step verdicts on KV loads."""


class KVGuardAsyncScheduler(_SameStepVerdicts, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling) with same-step verdicts
    on KV loads."""
