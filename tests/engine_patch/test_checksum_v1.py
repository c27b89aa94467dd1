"""Checksum v1 is fixed: known answers for its weights, ``mix``, the
fingerprints and offload tags, and a whole pass over a small KV and state.

Producer and consumer compare values each computes with its own copy of
KVGuard. The other tests compare the worker with a reference built on the
same weights, so a changed weight would pass them all and fail every load
between two versions that both send payload version 1. A change to these
values needs a new payload version (``engine_patch.payload``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from worker_helpers import recv_all

from engine_patch.hashing import (
    block_checksum_tags,
    layer_fingerprint,
    layer_head_weight,
    mix,
    piece_weight,
    position_weight,
    position_weights,
    splitmix64,
)
from engine_patch.worker import (
    KVChecksumWorker,
    KVLayer,
    KVLayout,
    KVStateLayer,
    StateTensor,
)

pytestmark = pytest.mark.usefixtures("both_passes")


def _bytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose bytes are a fixed sequence, whatever the platform."""
    size = torch.empty(0, dtype=dtype).element_size()
    *lead, last = shape
    count = int(np.prod(shape)) * size
    raw = (np.arange(count, dtype=np.uint64) * 2654435761 >> np.uint64(7)) % 256
    return torch.from_numpy(raw.astype(np.uint8)).view(*lead, last * size).view(dtype)


def test_the_weights_and_mix_are_v1s() -> None:
    # SplitMix64's published first output for seed 0.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert layer_head_weight(3, 5) == 0xF916BB2C572971DD
    assert position_weight(100) == 0xBDCC3EA7B95FF1E1
    assert int(position_weights(100, 101)[0]) == 0xBDCC3EA7B95FF1E1
    assert piece_weight(7) == 0xC8ED460858F1292D
    assert mix(0x0123456789ABCDEF) == 0x87CBFBFE89022CEA


def test_the_fingerprints_and_offload_tags_are_v1s() -> None:
    fingerprint = layer_fingerprint(
        "model.layers.0.self_attn",
        "full_attention",
        "bfloat16",
        256,
        total_num_kv_heads=8,
    )
    assert fingerprint == 0x58BB0B339F77BDF4
    tags = block_checksum_tags([b"h0", b"h1"], 0x1234)
    assert tags.tolist() == [0x6B1142F810961CE5, 0xEF4CF9093B19EE5D]


def test_a_pass_over_attention_kv_gives_v1s_values() -> None:
    # [K/V, blocks, tokens per block, heads, head size]; the second block
    # holds 3 of its 4 tokens.
    kv = _bytes_of((2, 3, 4, 2, 8), torch.bfloat16)
    layer = KVLayer("model.layers.1.self_attn", 1, 0, kv, KVLayout.SPLIT, head_offset=2)
    values = recv_all(KVChecksumWorker([layer]), [("r", 7, {0: (0, [2, 0])})])
    assert values["r"][0].ravel().tolist() == [0xC11E4BB33CF701A7, 0x69F2286EF0D22086]


def test_a_pass_over_a_state_gives_v1s_value() -> None:
    state = _bytes_of((3, 3, 4), torch.float32)
    layer = KVStateLayer("model.layers.2.mixer", 2, 0, (StateTensor(state),))
    values = recv_all(KVChecksumWorker([layer]), [("r", 9, {0: (0, [1])})])
    assert values["r"][0].ravel().tolist() == [0x27ECC31BE277E207]
