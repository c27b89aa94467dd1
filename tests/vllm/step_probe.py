"""Scheduler classes that count, per KV load, the engine steps from the step
whose workers finished the load to the step that sampled its first token,
for the P/D benchmark (benchmarks/bench_vllm_pd.py).

A load is finished in the first step whose worker output names it: in
``finished_recving``, or, with KVGuard's workers, among the loads they
checksummed (which, connector-only, they hold back from vLLM for a step).
Each count is logged: ``KVGuard step probe: request <id> first token
<n> steps after its load finished``. The probe adds a few dict lookups per
step, the same in every phase of the benchmark.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.scheduler import Scheduler

from engine_patch.vllm.scheduler import KVGuardScheduler

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput

# Under vLLM's logger: its handlers print it in the engine's log.
logger = logging.getLogger("vllm.kvguard_step_probe")

PROBE_TEXT = "KVGuard step probe: request"


class _StepProbe(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._probe_step = 0
        # Loads finished, by request id: the step.
        self._probe_loads: dict[str, int] = {}

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
    ) -> dict[int, EngineCoreOutputs]:
        self._probe_step += 1
        output = model_runner_output.kv_connector_output
        if output is not None:
            finished = set(output.finished_recving or ())
            for report in getattr(output.kv_connector_worker_meta, "reports", ()):
                finished.update(report.finished_loads)
            for req_id in finished - set(output.failed_recving):
                self._probe_loads.setdefault(req_id, self._probe_step)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id, step in list(self._probe_loads.items()):
            index = model_runner_output.req_id_to_index.get(req_id)
            if index is not None and model_runner_output.sampled_token_ids[index]:
                logger.info(
                    "%s %s first token %d steps after its load finished",
                    PROBE_TEXT,
                    req_id,
                    self._probe_step - step,
                )
                del self._probe_loads[req_id]
            elif req_id not in self.requests:
                del self._probe_loads[req_id]
        return outputs


class StepProbeScheduler(_StepProbe):
    """vLLM's own scheduler, probed."""


class StepProbeKVGuardScheduler(_StepProbe, KVGuardScheduler):
    """KVGuard's scheduler class, probed."""
