"""The producer's checksums of one request, as sent to its consumer: msgpack
(msgspec) bytes, base64 in ``kv_transfer_params["kv_checksums"]``."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import msgspec
import numpy as np

# The kv_transfer_params key carrying the base64 payload.
KV_TRANSFER_PARAMS_KEY = "kv_checksums"

# Version 1: the checksum of docs/checksum.md.
_PAYLOAD_VERSION = 1

# Checksums travel little-endian. They are compared as bytes
# (``verify.KVChecksumComparer``), so a big-endian host decodes them to its
# own order.
_UINT64_LE = np.dtype("<u8")
_LITTLE_ENDIAN = sys.byteorder == "little"

# Checksums decode to bytes (a copy, which the cyclic collector does not
# track), not to memoryviews of the payload: those are two tracked objects
# per group for as long as the load is pending, and each such object brings
# the scheduler's next collection nearer (docs/vllm.md).
_MsgType = tuple[int, int, int, list[tuple[int, int, int, int, bytes]]]
# Made once: ``msgspec.msgpack.decode(data, type=...)`` translates the type
# on every call, several times the cost of the decode itself.
_DECODER = msgspec.msgpack.Decoder(_MsgType)


@dataclass
class KVChecksumPayload:
    """A producer's checksums of one request, as sent to its consumer."""

    # The producer's TP size.
    tp_size: int
    # Tokens whose KV the checksummed blocks hold.
    num_tokens: int
    # Per KV cache group id: its fingerprint (``KVChecksumRecord.fingerprints``),
    # tokens per checksum (its span, ``kv_cache.checksum_spans``: a block, 16
    # tokens of a sliding-window block, 1 for a state), first span position,
    # and one uint64 checksum per span.
    groups: dict[int, tuple[int, int, int, np.ndarray]]

    def to_bytes(self) -> bytes:
        groups = [
            (
                group_id,
                fingerprint,
                block_size,
                start,
                # Encoded straight from the array's memory.
                np.ascontiguousarray(values, dtype=_UINT64_LE).data,
            )
            for group_id, (fingerprint, block_size, start, values) in (
                self.groups.items()
            )
        ]
        return msgspec.msgpack.encode(
            (_PAYLOAD_VERSION, self.tp_size, self.num_tokens, groups)
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> KVChecksumPayload:
        """Decode a payload; its checksums are read-only arrays.

        Raises:
            ValueError: If ``data`` is not a payload of this version.

        """
        try:
            version, tp_size, num_tokens, groups = _DECODER.decode(data)
            if version != _PAYLOAD_VERSION:
                raise ValueError(f"unsupported version {version}")
            if tp_size < 1 or num_tokens < 0:
                raise ValueError(f"bad TP size {tp_size} or token count {num_tokens}")
            for group_id, fingerprint, block_size, start, _ in groups:
                if block_size < 1 or start < 0 or not 0 <= fingerprint < 2**64:
                    raise ValueError(f"bad group {group_id}")
            if len({group[0] for group in groups}) != len(groups):
                # Which of a group's entries is the producer's is unknowable.
                raise ValueError("a group twice")
            return cls(
                tp_size,
                num_tokens,
                {
                    group_id: (
                        fingerprint,
                        block_size,
                        start,
                        _host_order(np.frombuffer(values, dtype=_UINT64_LE)),
                    )
                    for group_id, fingerprint, block_size, start, values in groups
                },
            )
        except ValueError as e:  # Includes msgspec's decode errors.
            raise ValueError(f"invalid KV checksums: {e}") from e

    def to_base64(self) -> str:
        """The payload as it goes into ``kv_transfer_params``."""
        return encode_base64(self.to_bytes())


def _host_order(values: np.ndarray) -> np.ndarray:
    """Little-endian ``values`` as the host's uint64."""
    return values if _LITTLE_ENDIAN else values.astype(np.uint64)


# msgspec's base64 (RFC 4648, padded) is three to four times faster than
# binascii's, whose cost per block the scheduler would pay on every request.


def encode_base64(data: bytes) -> str:
    """``data`` as the base64 text of ``kv_transfer_params``."""
    encoded = msgspec.to_builtins(data)
    assert isinstance(encoded, str)
    return encoded


def decode_base64(encoded: object) -> bytes:
    """The bytes of a ``kv_transfer_params`` payload; ``b""`` (not a payload
    either) if it is not padded base64 text: whole groups of four characters
    of the standard alphabet, ``=`` only to pad the last group, nothing else
    (no whitespace)."""
    if not isinstance(encoded, str):
        return b""
    try:
        return msgspec.convert(encoded, bytes)
    # UnicodeError: text with a lone surrogate (JSON's "\ud800") has no UTF-8.
    except (msgspec.ValidationError, UnicodeError):
        return b""
