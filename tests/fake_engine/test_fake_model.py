"""The fake engine's parts without HTTP: tokenizer and chat template, the
model's KV and its reading of the cache, TP workers, the KV wire format,
and the fault injector's corruptions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fake_engine.config import EngineConfig, FaultConfig, FaultKind, FaultSide
from fake_engine.faults import Fault, FaultInjector
from fake_engine.kv_cache import BlockPool, KVCacheManager
from fake_engine.model import FakeModel
from fake_engine.tokenizer import (
    EOS_TOKEN_ID,
    ChatTemplateError,
    NotMultimodalError,
    apply_chat_template,
    decode,
    encode,
)
from fake_engine.transfer import (
    KVHeader,
    KVPuller,
    PullRequest,
    TransferError,
    decode_kv,
    decode_pull_request,
    encode_kv,
    encode_pull_request,
)
from fake_engine.workers import TPWorker


def test_tokenizer_round_trips_utf8_and_skips_eos() -> None:
    text = "Grüße, KV! 🚀"
    assert decode(encode(text)) == text
    assert len(encode("abc")) == 3
    assert decode([*encode("ok"), EOS_TOKEN_ID]) == "ok"
    assert decode([*encode("ok"), EOS_TOKEN_ID], skip_special_tokens=False) == "ok</s>"


def test_chat_template_renders_roles_and_the_generation_prompt() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    assert apply_chat_template(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    )
    with pytest.raises(NotMultimodalError):
        apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatTemplateError, match="part type 'foo'"):
        apply_chat_template([{"role": "user", "content": [{"type": "foo"}]}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="has no role"):
        apply_chat_template([{"role": "", "content": "Hi"}])


def test_continuing_the_final_message_leaves_it_open() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hel"},
    ]
    closed = "<|user|>\nHi\n<|assistant|>\nHel\n"
    assert apply_chat_template(messages, add_generation_prompt=False) == closed
    assert (
        apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        )
        == closed[:-1]
    )


def test_kv_of_a_token_depends_on_its_whole_prefix() -> None:
    model = FakeModel(EngineConfig())
    a = model.kv(model.prefix_hashes(encode("xyz"), None))
    b = model.kv(model.prefix_hashes(encode("wyz"), None))
    again = model.kv(model.prefix_hashes(encode("xyz"), None))
    assert torch.equal(a, again)
    # Same last tokens, other first token: every position differs.
    assert all(not torch.equal(a[t], b[t]) for t in range(3))
    # Continuing a prefix gives the same KV as hashing it whole.
    first = model.prefix_hashes(encode("xy"), None)
    assert (
        model.prefix_hashes(encode("z"), first[-1])
        == model.prefix_hashes(encode("xyz"), None)[2:]
    )


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_workers_shard_heads_and_replicate_beyond_them(tp_size: int) -> None:
    config = EngineConfig(kv_heads=2, tp_size=tp_size, kv_checksums=False)
    workers = [TPWorker(config, rank) for rank in range(tp_size)]
    model = FakeModel(config)
    kv = model.kv(model.prefix_hashes(encode("some tokens"), None))
    slots = torch.arange(16, 16 + len(kv))
    for worker in workers:
        worker.write(slots, kv)
    heads = sorted(h for w in workers if w.replica_index == 0 for h in w.heads.tolist())
    assert heads == [0, 1]
    for worker in workers:
        assert torch.equal(worker.read(slots), kv[:, :, worker.heads])
    assert {w.replica_index for w in workers} == set(range(max(1, tp_size // 2)))


def test_a_flipped_bit_in_the_cache_changes_the_digest() -> None:
    config = EngineConfig(kv_checksums=False)
    model = FakeModel(config)
    kv = model.kv(model.prefix_hashes(encode("prompt"), None))
    heads = torch.arange(config.kv_heads)
    clean = model.head_digests(kv, heads)
    kv[3, 1, 0, 1].view(torch.uint8)[5] ^= 4
    assert not torch.equal(model.head_digests(kv, heads)[3], clean[3])
    assert torch.equal(model.head_digests(kv, heads)[:3], clean[:3])


def test_the_block_pool_hands_out_every_block_and_reuses_the_first_freed() -> None:
    pool = BlockPool(5)  # block 0 is the null block
    blocks = pool.allocate(4)
    assert blocks is not None and [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.free(blocks[2:])
    assert pool.recently_freed(exclude=set()) == 4
    assert [b.block_id for b in pool.allocate(1) or []] == [3]
    assert pool.recently_freed(exclude={4}) is None


def test_a_block_table_grows_whole_or_not_at_all() -> None:
    manager = KVCacheManager(BlockPool(4), block_size=16)
    assert manager.allocate_slots("a", 17) and manager.block_ids("a") == [1, 2]
    assert manager.allocate_slots("a", 32) and manager.num_blocks("a") == 2
    assert not manager.allocate_slots("b", 33)  # 3 blocks, 1 free
    assert manager.num_blocks("b") == 0 and manager.pool.num_free == 1
    assert not manager.allocate_slots("a", 64)  # 2 more blocks, 1 free
    assert manager.block_ids("a") == [1, 2] and manager.pool.num_free == 1
    assert manager.slots("a", 15, 18).tolist() == [31, 32, 33]
    assert manager.free("a") == 2 and manager.pool.num_free == 3


def _kv_answer(num_tokens: int) -> tuple[KVHeader, torch.Tensor, bytearray]:
    """A pull's answer of two blocks of 16 (32 slots of the default model)
    for ``num_tokens`` tokens: its header, its KV and its bytes."""
    model = FakeModel(EngineConfig())
    kv = model.kv(model.prefix_hashes(encode("x" * 32), None))
    header = KVHeader(1, "eng", "req", num_tokens, 16, 2, 2, 2, 16, "float16")
    return header, kv, bytearray(b"".join(bytes(p) for p in encode_kv(header, kv)))


def test_kv_wire_format_round_trips_and_refuses_other_models() -> None:
    header, kv, data = _kv_answer(30)
    got_header, got = decode_kv(data, header)
    assert got_header == header and torch.equal(got, kv)
    full, _, data_full = _kv_answer(32)
    assert decode_kv(data_full, full)[0].num_tokens == 32
    other = KVHeader(1, "", "", 0, 16, 0, 3, 2, 16, "float16")
    with pytest.raises(TransferError, match="not this model's"):
        decode_kv(data, other)
    with pytest.raises(TransferError):
        decode_kv(data[:-1], header)
    with pytest.raises(TransferError):
        decode_kv(bytearray(b"\x01"), header)
    pull = PullRequest("eng", "req", [[1, 2]])
    assert decode_pull_request(encode_pull_request(pull)) == pull
    with pytest.raises(TransferError):
        decode_pull_request(b"garbage")
    for no_blocks in ([], [[]], [[1], []]):
        with pytest.raises(TransferError, match="no blocks"):
            decode_pull_request(encode_pull_request(PullRequest("e", "r", no_blocks)))


async def test_a_puller_closes_its_connections() -> None:
    puller = KVPuller()
    await puller.close()  # before start: nothing to close
    await puller.start()
    session = puller._session
    assert session is not None and not session.closed
    await puller.close()
    assert session.closed


@pytest.mark.parametrize("num_tokens", [-1, 33])
def test_kv_answer_claiming_tokens_its_blocks_cannot_hold_is_refused(
    num_tokens: int,
) -> None:
    header, _, data = _kv_answer(num_tokens)
    with pytest.raises(TransferError, match="token count"):
        decode_kv(data, header)


@pytest.mark.parametrize("kind", [k for k in FaultKind if k.corrupts])
@settings(deadline=None, max_examples=40)
@given(
    num_tokens=st.integers(min_value=2, max_value=70),
    block_size=st.sampled_from([1, 2, 3, 16, 32]),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_each_corruption_changes_kv_the_consumer_uses(
    kind: FaultKind, num_tokens: int, block_size: int, seed: int
) -> None:
    padded, corrupted = _corrupted(kind, num_tokens, block_size, seed)
    # The last prompt token is recomputed by the consumer: not counted.
    assert not torch.equal(corrupted[: num_tokens - 1], padded[: num_tokens - 1])


def _corrupted(
    kind: FaultKind, num_tokens: int, block_size: int, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's KV in whole blocks, and the same KV corrupted by ``kind``
    (stale KV from another prompt)."""
    model = FakeModel(EngineConfig())
    kv = model.kv(model.prefix_hashes(encode("k" * num_tokens), None))
    assert kv.shape[0] == num_tokens
    slots = -(-num_tokens // block_size) * block_size
    padded = torch.zeros((slots, *kv.shape[1:]), dtype=kv.dtype)
    padded[:num_tokens] = kv
    stale = model.kv(model.prefix_hashes(encode("s" * block_size), None))
    corrupted = padded.clone()
    FaultInjector.corrupt(
        Fault(kind, seed), corrupted, num_tokens, block_size, lambda n: stale[:n]
    )
    return padded, corrupted


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "unit"), [(20, 16, 16), (40, 16, 16), (3, 16, 1)]
)
def test_swap_exchanges_two_blocks_or_a_lone_blocks_first_two_tokens(
    num_tokens: int, block_size: int, unit: int
) -> None:
    padded, corrupted = _corrupted(FaultKind.SWAP, num_tokens, block_size)
    parts = range(0, padded.shape[0], unit)
    changed = [
        i
        for i in parts
        if not torch.equal(corrupted[i : i + unit], padded[i : i + unit])
    ]
    assert len(changed) == 2, changed
    a, b = (slice(i, i + unit) for i in changed)
    assert torch.equal(corrupted[a], padded[b]) and torch.equal(corrupted[b], padded[a])
    if unit == 1:
        assert changed == [0, 1]


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "unit"),
    [(40, 16, 16), (20, 16, 16), (3, 16, 1), (2, 1, 1), (9, 16, 1)],
)
def test_shift_moves_kv_down_one_block_or_a_lone_blocks_tokens_down_one(
    num_tokens: int, block_size: int, unit: int
) -> None:
    padded, corrupted = _corrupted(FaultKind.SHIFT, num_tokens, block_size)
    end = padded.shape[0] if unit > 1 or block_size == 1 else num_tokens
    assert torch.equal(corrupted[: end - unit], padded[unit:end])
    assert not corrupted[end - unit : end].any()


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "last", "kept"),
    # The last block the consumer uses (the prompt's last token is recomputed)
    # keeps the first half of the tokens it holds.
    [(40, 16, 2, 35), (33, 16, 1, 24), (20, 16, 1, 17), (3, 16, 0, 1), (2, 1, 0, 0)],
)
def test_truncate_zeroes_the_last_used_block_after_half_its_tokens(
    num_tokens: int, block_size: int, last: int, kept: int
) -> None:
    slots = -(-num_tokens // block_size) * block_size
    kv = torch.zeros((slots, 1, 1, 2, 2))
    kv[:num_tokens] = torch.arange(1.0, num_tokens + 1).reshape(-1, 1, 1, 1, 1)
    corrupted = kv.clone()
    report = FaultInjector.corrupt(
        Fault(FaultKind.TRUNCATE), corrupted, num_tokens, block_size, torch.zeros
    )
    start, end = last * block_size, (last + 1) * block_size
    assert torch.equal(corrupted[:kept], kv[:kept])
    assert not corrupted[kept:end].any()
    assert torch.equal(corrupted[end:], kv[end:])
    assert report == f"truncated block {last} after {kept - start} tokens"


def test_fault_injector_honours_side_rate_and_count() -> None:
    injector = FaultInjector(FaultConfig(FaultKind.ZERO, FaultSide.CONSUMER, count=2))
    assert injector.draw(FaultSide.PRODUCER).kind is FaultKind.NONE
    draws = [injector.draw(FaultSide.CONSUMER).kind for _ in range(3)]
    assert draws == [FaultKind.ZERO, FaultKind.ZERO, FaultKind.NONE]
    assert injector.injected == {("zero", "consumer"): 2}
    injector.configure(FaultConfig(FaultKind.ZERO, rate=0.5))
    draws = [injector.draw(FaultSide.PRODUCER).kind for _ in range(400)]
    hits = draws.count(FaultKind.ZERO)
    assert 150 < hits < 250


@pytest.mark.parametrize(
    "bad",
    [
        {"kv_heads": 3, "tp_size": 2},
        {"tp_size": 3, "kv_heads": 2},
        {"head_size": 2},
        {"num_blocks": 4, "max_model_len": 2048},
        {"dtype": "int4"},
        {"lease_s": 0},
    ],
)
def test_inconsistent_config_is_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        EngineConfig(**bad)
