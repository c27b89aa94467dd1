"""The KV pull's wire format: what a consumer asks its producer for, and the
binary answer (a msgpack header, then raw KV bytes), standing for a NIXL
read of the producer's blocks.

KV travels as ``[tokens, layers, heads, 2, head_size]`` over all KV heads
(one copy of each), tokens of whole producer blocks, so the consumer can
land it on any TP size and block size.
"""

from __future__ import annotations

import struct

import msgspec
import torch

from fake_engine.config import DTYPES

# The producer's route serving pulls.
PULL_PATH = "/kvguard/kv/pull"
PULL_CONTENT_TYPE = "application/x-kvguard-kv"
_VERSION = 1
_HEADER_LENGTH = struct.Struct("<I")


class TransferError(Exception):
    """A pull that cannot be served or landed."""


class PullRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A consumer's request for a producer's held KV (msgpack)."""

    engine_id: str
    request_id: str
    # Per KV cache group, the producer's block ids to read.
    block_ids: list[list[int]]


class KVHeader(msgspec.Struct):
    """What the KV bytes after it are."""

    version: int
    engine_id: str
    request_id: str
    # Tokens of the request the blocks hold; the body has whole blocks.
    num_tokens: int
    block_size: int
    num_blocks: int
    layers: int
    heads: int
    head_size: int
    dtype: str

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def encode_pull_request(pull: PullRequest) -> bytes:
    return msgspec.msgpack.encode(pull)


def decode_pull_request(data: bytes) -> PullRequest:
    """Raises:
    TransferError: If ``data`` is not a pull request.
    """
    try:
        pull = msgspec.msgpack.decode(data, type=PullRequest)
    except msgspec.DecodeError as e:
        raise TransferError(f"invalid pull request: {e}") from e
    if not pull.block_ids or not all(pull.block_ids):
        raise TransferError("invalid pull request: no blocks")
    return pull


def encode_kv(header: KVHeader, kv: torch.Tensor) -> list[bytes | memoryview]:
    """The answer to a pull: header length, header, then ``kv``'s bytes
    (zero-copy), as parts to write in order."""
    head = msgspec.msgpack.encode(header)
    body = kv.contiguous().view(torch.uint8).reshape(-1).numpy()
    return [_HEADER_LENGTH.pack(len(head)) + head, body.data]


def decode_kv(data: bytearray, expected: KVHeader) -> tuple[KVHeader, torch.Tensor]:
    """The header and KV of a pull's answer (the tensor shares ``data``).

    Args:
        data: The whole answer.
        expected: The consumer's model shape and dtype (its other fields
            are not compared).

    Raises:
        TransferError: If the answer is malformed or holds another model's KV.

    """
    try:
        (length,) = _HEADER_LENGTH.unpack_from(data)
        end = _HEADER_LENGTH.size + length
        header = msgspec.msgpack.decode(
            bytes(data[_HEADER_LENGTH.size : end]), type=KVHeader
        )
    except (struct.error, msgspec.DecodeError) as e:
        raise TransferError(f"malformed KV answer: {e}") from e
    if header.version != _VERSION:
        raise TransferError(f"unsupported KV answer version {header.version}")
    shape = (header.layers, header.heads, header.head_size, header.dtype)
    want = (expected.layers, expected.heads, expected.head_size, expected.dtype)
    if shape != want:
        raise TransferError(
            f"the producer's KV (layers, heads, head size, dtype) {shape} "
            f"is not this model's {want}"
        )
    if header.dtype not in DTYPES:
        raise TransferError(f"unknown dtype {header.dtype!r}")
    dtype = DTYPES[header.dtype]
    cache_dtype = torch.uint8 if header.dtype == "fp8" else dtype
    element_size = torch.empty((), dtype=cache_dtype).element_size()
    shape5 = (header.num_slots, header.layers, header.heads, 2, header.head_size)
    expected_bytes = element_size
    for size in shape5:
        expected_bytes *= size
    if len(data) - end != expected_bytes:
        raise TransferError(
            f"KV answer holds {len(data) - end} bytes, its header says {expected_bytes}"
        )
    if header.num_tokens > header.num_slots or header.num_tokens < 0:
        raise TransferError("KV answer's token count exceeds its blocks")
    if not expected_bytes:
        return header, torch.empty(shape5, dtype=cache_dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, offset=end, count=expected_bytes)
    return header, flat.view(cache_dtype).view(shape5)
