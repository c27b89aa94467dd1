"""Model shapes and producer/consumer pairs of simulated engines
(``pd_sim``) that the end-to-end tests share."""

from __future__ import annotations

from typing import NamedTuple

from pd_sim import (
    GroupShape,
    ModelShape,
    SimEngine,
    StateGroupShape,
)

from engine_patch.worker import KVLayout

# 4 layers, 2 KV heads, float16 head size 4: 16-byte cells of 2 pieces.
MODEL = ModelShape()


def engines(
    producer: tuple[int, int] = (1, 1),
    consumer: tuple[int, int] = (1, 1),
    *,
    producer_bs: int = 16,
    consumer_bs: int = 16,
    fail_closed: bool = True,
    producer_model: ModelShape = MODEL,
    consumer_model: ModelShape = MODEL,
) -> tuple[SimEngine, SimEngine]:
    return (
        SimEngine(
            producer_model,
            tp=producer[0],
            pp=producer[1],
            block_size=producer_bs,
            layout=KVLayout.SPLIT,
            seed=1,
        ),
        SimEngine(
            consumer_model,
            tp=consumer[0],
            pp=consumer[1],
            block_size=consumer_bs,
            layout=KVLayout.PACKED_HND,
            fail_closed=fail_closed,
            seed=2,
        ),
    )


# A sliding window of 40 tokens: not a whole number of blocks.
WINDOW = 40


# vLLM groups a hybrid's layers in groups of one size: here 2 attention
# layers and 4 Mamba2 layers. Group 1 is checksummed per request in one
# block (mamba_cache_mode "none") with a speculative scratch block after it;
# group 2's state sits in the last of null blocks ("align").
HYBRID = ModelShape(
    groups=(
        GroupShape(layers=(0, 3)),
        StateGroupShape(layers=(1, 2), num_speculative_blocks=1),
        StateGroupShape(layers=(4, 5), cache_mode="align"),
    )
)


# Full attention, a sliding window and a state group whose conv state is
# state-length first (SD).
HYBRID_SLIDING = ModelShape(
    groups=(
        GroupShape(layers=(0,)),
        GroupShape(layers=(3,), sliding_window=WINDOW),
        StateGroupShape(layers=(1, 2), conv_layout="SD", cache_mode="align"),
    )
)


# States every TP rank holds whole (MambaSpec.tp_replicated).
HYBRID_REPLICATED = ModelShape(
    groups=(
        GroupShape(layers=(0, 3)),
        StateGroupShape(layers=(1, 2), tp_replicated=True),
    )
)


# States whose TP split neither side knows (no MambaSpec.state_splits).
HYBRID_UNKNOWN_SPLIT = ModelShape(
    groups=(
        GroupShape(layers=(0, 3)),
        StateGroupShape(layers=(1, 2), known_split=False, num_speculative_blocks=1),
    )
)


# The same model on a consumer with Mamba prefix caching ("align") and
# speculative decoding (scratch blocks after group 2's state too).
HYBRID_ALIGNED = ModelShape(
    groups=(
        GroupShape(layers=(0, 3)),
        StateGroupShape(layers=(1, 2), num_speculative_blocks=1, cache_mode="align"),
        StateGroupShape(layers=(4, 5), num_speculative_blocks=2, cache_mode="align"),
    )
)


# A full-attention group and a sliding-window group (WINDOW: not a whole
# number of blocks).
SLIDING = ModelShape(
    groups=(
        GroupShape(layers=(0, 1)),
        GroupShape(layers=(2, 3), sliding_window=WINDOW),
    )
)


# Producer and consumer (TP, PP) pairings of MODEL.
PAIRINGS = {
    "(1,1)->(1,1)": ((1, 1), (1, 1)),
    "(2,1)->(1,1)": ((2, 1), (1, 1)),
    "(1,1)->(2,1)": ((1, 1), (2, 1)),
    "(1,1)->(4,1) replicas": ((1, 1), (4, 1)),
    "(1,2)->(1,1)": ((1, 2), (1, 1)),
    "(1,1)->(2,2)": ((1, 1), (2, 2)),
}


class CleanPairing(NamedTuple):
    """A producer and a consumer of one model whose clean loads verify."""

    model: ModelShape
    producer: tuple[int, int]  # (TP, PP)
    consumer: tuple[int, int]
    producer_bs: int
    consumer_bs: int
    # The consumer's, if it differs (in state block layout only).
    consumer_model: ModelShape | None = None


CLEAN_PAIRINGS = [
    *(CleanPairing(MODEL, p, c, 16, 16) for p, c in PAIRINGS.values()),
    CleanPairing(MODEL, (1, 1), (1, 1), 16, 32),
    CleanPairing(MODEL, (2, 1), (1, 2), 32, 16),
    CleanPairing(SLIDING, (1, 1), (2, 1), 16, 32),
    CleanPairing(SLIDING, (2, 1), (1, 1), 32, 16),
    CleanPairing(SLIDING, (1, 2), (1, 1), 32, 16),
    # Hybrids: Mamba states between TP sizes 1, 2 and 4 (x, B, C and heads
    # split), attention at block sizes 16 and 32.
    CleanPairing(HYBRID, (1, 1), (2, 1), 16, 32),
    CleanPairing(HYBRID, (4, 1), (1, 1), 32, 16),
    CleanPairing(HYBRID, (2, 1), (4, 1), 16, 16),
    CleanPairing(HYBRID, (1, 1), (1, 1), 32, 32),
    CleanPairing(HYBRID, (2, 1), (1, 1), 16, 16, HYBRID_ALIGNED),
    CleanPairing(HYBRID_SLIDING, (2, 1), (1, 1), 16, 32),
    CleanPairing(HYBRID_SLIDING, (1, 1), (4, 1), 32, 16),
    CleanPairing(HYBRID_REPLICATED, (1, 1), (2, 1), 16, 32),
    CleanPairing(HYBRID_UNKNOWN_SPLIT, (2, 1), (2, 1), 32, 16),
    # NIXL moves no Mamba state under PP; KVGuard's checksums add up anyway.
    CleanPairing(HYBRID, (1, 2), (2, 1), 16, 32),
]
