"""On a CPU an eager checksum pass runs in numpy, with no call into torch:
in an engine each call runs with cold caches, where torch's cost several
times numpy's (``bench_checksum.py``, caches cold). Its values are the
torch pass's (every test of test_worker*.py runs both)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from worker_helpers import MIXED_REQUESTS, layers_in_one_buffer, recv_all

from engine_patch.worker import KVChecksumWorker, KVLayout

REQUESTS = [(req_id, n, {0: (start, ids)}) for req_id, n, start, ids in MIXED_REQUESTS]


class TorchCalls(TorchFunctionMode):
    """The torch functions and tensor methods this thread calls."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.names.add(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def torch_calls_of_a_pass(worker: KVChecksumWorker) -> set[str]:
    """What of torch a load pass of :data:`REQUESTS` and its record call."""
    recv_all(worker, REQUESTS)  # first-use work out of the way
    with TorchCalls() as calls:
        recv_all(worker, REQUESTS)
    return calls.names


def test_an_eager_cpu_pass_makes_no_torch_call() -> None:
    layers = layers_in_one_buffer(KVLayout.PACKED_HND, torch.bfloat16)
    assert torch_calls_of_a_pass(KVChecksumWorker(layers, compile=False)) == set()


def test_the_torch_pass_is_still_there_on_request() -> None:
    layers = layers_in_one_buffer(KVLayout.PACKED_HND, torch.bfloat16)
    worker = KVChecksumWorker(layers, compile=False, host_pass=False)
    assert "index_select" in torch_calls_of_a_pass(worker)


def test_both_passes_give_the_same_values() -> None:
    for layout in KVLayout:
        layers = layers_in_one_buffer(layout, torch.bfloat16, block_major=True)
        host = recv_all(KVChecksumWorker(layers, compile=False), REQUESTS)
        ops = recv_all(
            KVChecksumWorker(layers, compile=False, host_pass=False), REQUESTS
        )
        assert host.keys() == ops.keys()
        for req_id, groups in host.items():
            for group_id, values in groups.items():
                assert (values == ops[req_id][group_id]).all(), (layout, req_id)


def test_a_pass_copies_its_blocks_not_the_whole_cache() -> None:
    # K and V in separate planes: the rows are not one C-contiguous array,
    # which np.take would first copy whole.
    layers = layers_in_one_buffer(KVLayout.SPLIT, torch.bfloat16, num_blocks=4096)
    cache_bytes = sum(layer.kv.numel() * layer.kv.element_size() for layer in layers)
    worker = KVChecksumWorker(layers, compile=False)
    load = [("r", 9, {0: (0, [1, 2, 3])})]
    recv_all(worker, load)
    tracemalloc.start()
    try:
        recv_all(worker, load)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < cache_bytes / 20, (peak, cache_bytes)
