"""The sliding-window blocks KVGuard checksums are the ones vLLM 0.32's
NixlConnector transfers: its scheduler's ``blocks_per_sw`` for each window
and block size, including windows one token past a whole number of blocks.
"""

from __future__ import annotations

import pytest
import torch
from engine_steps import LAYERS, vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from engine_patch.kv_cache import sliding_window_transfer_blocks
from engine_patch.vllm.host import convert_kv_cache_config

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [8, 16, 17, 31, 33, 64, 65, 4096, 4097])
def test_kvguard_keeps_the_sliding_window_blocks_nixl_transfers(
    block_size: int, window: int
) -> None:
    shape = {
        "block_size": block_size,
        "num_kv_heads": 2,
        "head_size": 32,
        "dtype": torch.bfloat16,
    }
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(LAYERS[:1], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(
                LAYERS[1:], SlidingWindowSpec(**shape, sliding_window=window)
            ),
        ],
    )
    engine = vllm_config("kv_consumer", block_size=block_size)
    nixl = NixlPullConnectorScheduler(engine, "engine", config)
    ours = convert_kv_cache_config(config, fail_closed=True, vllm_config=engine)
    kept = [
        sliding_window_transfer_blocks(g.kv_cache_spec) for g in ours.kv_cache_groups
    ]
    assert kept == nixl.blocks_per_sw
