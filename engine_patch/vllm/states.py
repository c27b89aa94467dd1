"""vLLM 0.32's state (Mamba) layers as engine_patch's
:class:`~engine_patch.worker.KVStateLayer`: the states each layer's pages
hold, and where TP puts this rank's share of each in the unsharded state.

vLLM hands a state layer ``[blocks, 1, 1, page bytes]`` int8 pages, each
holding the layer's states one after the other as ``MambaBase.bind_kv_cache``
cuts them (``MambaSpec.shapes``/``dtypes``, the rank's shares; any padding
after them). P/D connectors move exactly those states: NixlConnector reads
the conv state's sub-projections and the SSM state
(``derive_mamba_conv_split``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from vllm.v1 import kv_cache_interface as vllm_specs
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from engine_patch.worker import KVStateLayer, StateShard, StateTensor, state_views

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# State kinds whose two states (conv, then SSM/temporal) are what
# NixlConnector transfers, and whose TP split vLLM's conv-transfer helper
# derives.
SUPPORTED_STATE_TYPES = (
    MambaAttentionBackendEnum.MAMBA1,
    MambaAttentionBackendEnum.MAMBA2,
    MambaAttentionBackendEnum.GDN_ATTN,
)

# Where models keep Mamba2's group count (vLLM's model files read these).
_N_GROUPS_ATTRS = ("mamba_n_groups", "n_groups", "mamba_ngroups")


def is_supported(spec: vllm_specs.MambaSpec) -> bool:
    """Whether KVGuard checksums a state group of this spec: a conv and an
    SSM state of a kind P/D connectors move whole."""
    return spec.mamba_type in SUPPORTED_STATE_TYPES and len(spec.shapes) == 2


def model_n_groups(vllm_config: VllmConfig) -> int | None:
    """The model's Mamba2 group count (B and C of the conv state), if its
    config names it."""
    hf_config = vllm_config.model_config.hf_text_config
    for attr in _N_GROUPS_ATTRS:
        value = getattr(hf_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def state_shards(
    spec: vllm_specs.MambaSpec,
    tp_size: int,
    tp_rank: int,
    n_groups: int | None,
) -> tuple[StateShard, ...] | None:
    """Rank ``tp_rank``'s share of each state of a supported spec in the
    unsharded state, or None where vLLM's layout does not say it.

    The conv state (vLLM's "DS" layout: ``[conv dim, kernel - 1]``) is split
    along its conv dim part by part (Mamba2: x, B, C; GDN: Q, K, V; Mamba1:
    x), as ``derive_mamba_conv_split`` decomposes it; the SSM state along its
    heads (dim 0). None for the "SD" conv layout, and for Mamba2 over a TP
    size its group count does not divide (vLLM then replicates groups, so a
    share is not a slice of the model's state). States every rank holds
    whole (``tp_replicated``) are whole shares.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, ssm = (tuple(shape) for shape in spec.shapes)
    if spec.tp_replicated:
        return StateShard(conv), StateShard(ssm)
    if not is_conv_state_dim_first():
        return None
    if spec.mamba_type == MambaAttentionBackendEnum.MAMBA2 and (
        tp_size > 1 and (n_groups is None or n_groups % tp_size)
    ):
        return None
    try:
        split = derive_mamba_conv_split(spec, tp_size)
    except (AssertionError, NotImplementedError):
        # Shapes it cannot decompose: no known split.
        return None
    conv_shape = (conv[0] * tp_size, *conv[1:])
    ssm_shape = (ssm[0] * tp_size, *ssm[1:])
    parts = [dim * tp_size for dim in split.local_proj_dims]
    return (
        StateShard.split(conv_shape, 0, tp_size, tp_rank, parts),
        StateShard.split(ssm_shape, 0, tp_size, tp_rank),
    )


def state_layer(
    name: str,
    index: int,
    group_id: int,
    pages: torch.Tensor,
    spec: vllm_specs.MambaSpec,
    shards: tuple[StateShard, ...] | None,
    *,
    tp_size: int,
    tp_rank: int,
) -> KVStateLayer:
    """One state layer's states cut out of its ``pages`` as vLLM binds them.

    Raises:
        ValueError: If the states do not fit in a page.
    """
    views = state_views(pages, spec.shapes, spec.dtypes)
    placed: Sequence[StateShard | None] = shards or [None] * len(views)
    replicas, replica_index = (tp_size, tp_rank) if spec.tp_replicated else (1, 0)
    return KVStateLayer(
        name=name,
        index=index,
        group_id=group_id,
        states=tuple(
            StateTensor(view, shard) for view, shard in zip(views, placed, strict=True)
        ),
        replicas=replicas,
        replica_index=replica_index,
    )
