"""A producer prompt's block ids as vLLM's scheduler output lists them for
its workers, kept over the steps of a chunked prefill: a new (or resumed)
request's all, then each step's new ones appended. The step that finishes
the prompt hands them to the checksum scheduler, which then reads no block
object per block (the cost of a long prompt, always chunked, would
otherwise be one attribute read per block in that step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from engine_patch.host import BlockIds

# Kinds whose blocks a request keeps until it ends, so that appending each
# step's new ids gives its block table. A sliding window's blocks leave it
# (vLLM puts the null block in their place, which the workers' lists never
# show): such models read the blocks.
_APPEND_ONLY = (FullAttentionSpec, MLAAttentionSpec)


class StepBlockIds:
    """One step's block ids per scheduled request, as its scheduler output
    lists them; indexed on first use."""

    def __init__(self, scheduler_output: SchedulerOutput) -> None:
        self._output = scheduler_output
        self._new: dict[str, tuple[list[int], ...]] | None = None
        self._cached: dict[str, int] | None = None

    def new(self, req_id: str) -> tuple[list[int], ...] | None:
        """A new request's block ids per group (all of them), or None if the
        step has no such new request."""
        if self._new is None:
            self._new = {
                new.req_id: new.block_ids for new in self._output.scheduled_new_reqs
            }
        return self._new.get(req_id)

    def cached(self, req_id: str) -> tuple[bool, tuple[list[int], ...] | None] | None:
        """A scheduled request's that is not new: whether it resumes (its ids
        are all of them) and its ids (else only the step's new ones; None if
        none); None if the step lists no such request."""
        cached = self._output.scheduled_cached_reqs
        if self._cached is None:
            self._cached = {req_id: i for i, req_id in enumerate(cached.req_ids)}
        index = self._cached.get(req_id)
        if index is None:
            return None
        return req_id in cached.resumed_req_ids, cached.new_block_ids[index]


class PrefillBlockIds:
    """The block ids of producer prompts being prefilled, per request.

    Invariant: a request's entry is its block ids per group as vLLM's
    workers hold them after the last step that scheduled it, for requests
    whose prompt is not finished and that every step since their first
    listed (an entry is made only from a list of all of a request's ids).
    """

    def __init__(self, kv_cache_config: KVCacheConfig) -> None:
        self.enabled = all(
            type(group.kv_cache_spec) in _APPEND_ONLY
            for group in kv_cache_config.kv_cache_groups
        )
        self._ids: dict[str, tuple[list[int], ...]] = {}

    def step(
        self,
        step: StepBlockIds,
        req_id: str,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        num_prompt_tokens: int,
    ) -> BlockIds | None:
        """Take a producer request's ids of a step that schedules
        ``num_scheduled_tokens`` of it after ``num_computed_tokens``; its
        block ids per group if the step finishes its prompt and they are
        known (else the caller reads its blocks)."""
        if num_computed_tokens >= num_prompt_tokens:
            # Decoding: no prefill to checksum.
            self._ids.pop(req_id, None)
            return None
        ids = step.new(req_id)
        if ids is None:
            listed = step.cached(req_id)
            if listed is None:
                self._ids.pop(req_id, None)
                return None
            resumed, added = listed
            if resumed:
                ids = added
            elif (ids := self._ids.get(req_id)) is not None and added:
                if len(added) != len(ids):
                    del self._ids[req_id]
                    return None
                for group_ids, more in zip(ids, added, strict=True):
                    group_ids.extend(more)
            if ids is None:
                return None
        if num_computed_tokens + num_scheduled_tokens >= num_prompt_tokens:
            self._ids.pop(req_id, None)
            return ids
        if ids is not self._ids.get(req_id):
            # Copied: in process, vLLM's worker extends these very lists.
            self._ids[req_id] = tuple(list(group_ids) for group_ids in ids)
        return None

    def discard(self, req_id: str) -> None:
        """Forget a request (finished or aborted)."""
        self._ids.pop(req_id, None)

    def held_request_ids(self) -> set[str]:
        """The requests whose ids are kept: prompts being prefilled."""
        return set(self._ids)
