"""P/D KV transfers between fake engines, standing for NIXL reads of a
producer's blocks: the pull's wire format (what a consumer asks its producer
for, and the binary answer: a msgpack header, then raw KV bytes), the
consumer's HTTP client (:class:`KVPuller`), and the producer's leases on the
KV it holds for its consumers (:class:`Leases`).

KV travels as ``[tokens, layers, heads, 2, head_size]`` over all KV heads
(one copy of each), tokens of whole producer blocks, so the consumer can
land it on any TP size and block size.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
import msgspec
import torch

from fake_engine.config import DTYPES
from fake_engine.request import EngineRequest, RemoteSource

# The producer's route serving pulls.
PULL_PATH = "/kvguard/kv/pull"
PULL_CONTENT_TYPE = "application/x-kvguard-kv"
_VERSION = 1
_HEADER_LENGTH = struct.Struct("<I")


class TransferError(Exception):
    """A pull that cannot be served or landed."""


class PullError(Exception):
    """A pull the producer refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


class KVPuller:
    """A consumer's reads of its producers' held KV, over HTTP. Start it in a
    running event loop."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No overall timeout: a transfer that hangs hangs, as a NIXL read can;
        # the request's client or an abort ends it.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def pull(
        self, source: RemoteSource, expected: KVHeader
    ) -> tuple[KVHeader, torch.Tensor]:
        """The header and KV of the source's blocks, as its producer holds
        them (see :func:`decode_kv` for ``expected``).

        Raises:
            TransferError: If the producer cannot be reached, refuses the
                pull, or answers with malformed or another model's KV.

        """
        assert self._session is not None, "KVPuller.start() first"
        body = encode_pull_request(
            PullRequest(source.engine_id, source.request_id, source.block_ids)
        )
        url = f"http://{source.host}:{source.port}{PULL_PATH}"
        try:
            async with self._session.post(
                url, data=body, headers={"Content-Type": PULL_CONTENT_TYPE}
            ) as response:
                if response.status != 200:
                    # Whatever its charset says: the bytes are only quoted.
                    text = (await response.read())[:500].decode("utf-8", "replace")
                    raise TransferError(
                        f"the producer answered the pull with {response.status}: {text}"
                    )
                data = bytearray(await response.read())
        except (aiohttp.ClientError, OSError) as e:
            raise TransferError(str(e)) from e
        return decode_kv(data, expected)


@dataclass
class HeldKV:
    """A finished producer request's KV, kept for its consumer."""

    request: EngineRequest
    expiry: float
    pulling: bool = False


class Leases:
    """The KV a producer holds for its consumers' pulls, per request id: each
    until it is pulled, aborted or its lease of ``lease_s`` ends."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._held: dict[str, HeldKV] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def hold(self, request: EngineRequest) -> None:
        """Hold a finished request's KV for its lease."""
        self._held[request.request_id] = HeldKV(
            request, time.monotonic() + self.lease_s
        )

    def drop(self, req_id: str) -> HeldKV | None:
        """Stop holding a request's KV; what was held, if any."""
        return self._held.pop(req_id, None)

    def claim(self, pull: PullRequest, engine_id: str, block_ids: list[int]) -> HeldKV:
        """Start serving a pull of KV held on engine ``engine_id`` in the
        request's ``block_ids``; the caller clears ``pulling`` when done.

        Raises:
            PullError: If the pull is for another engine, for KV not held (or
                being pulled), or for other blocks.

        """
        if pull.engine_id != engine_id:
            raise PullError(409, f"this is engine {engine_id}, not {pull.engine_id}")
        held = self._held.get(pull.request_id)
        if held is None:
            raise PullError(
                404,
                f"no KV held for request {pull.request_id}: never held, "
                "pulled already, aborted, or its lease expired",
            )
        if held.pulling:
            raise PullError(409, f"the KV of request {pull.request_id} is being pulled")
        wanted = pull.block_ids[0]
        if len(pull.block_ids) != 1 or not set(wanted) <= set(block_ids):
            raise PullError(400, f"request {pull.request_id} holds other blocks")
        held.pulling = True
        return held

    def check_held(self, held: HeldKV) -> None:
        """Raises:
        PullError: If ``held`` was dropped (aborted, or its lease ended)
            while its pull waited.
        """
        request_id = held.request.request_id
        if self._held.get(request_id) is not held:
            raise PullError(410, f"the KV of request {request_id} was dropped")

    async def expire(self, release: Callable[[str], None]) -> None:
        """Forever: ``release`` each request whose lease has ended."""
        interval = min(1.0, self.lease_s / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for req_id, held in list(self._held.items()):
                if held.expiry <= now:
                    release(req_id)
