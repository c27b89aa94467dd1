"""The scheduler's and workers' messages (:mod:`engine_patch.types`) as
msgpack bytes, for hosts that send them between processes.

vLLM pickles each step's connector metadata to its workers and their output
back. Pickled one object at a time (each dataclass, each numpy array), a
load's worker record added about 350 µs to pickling and unpickling vLLM's
step output with the caches an engine step leaves cold, against about
200 µs as one msgpack blob.

Neither side may fail on what it is handed: :func:`encode_record` returns
None for anything it cannot encode as a record (the host sends that as it
is), and :func:`decode_record` gives back the bytes it cannot decode, which
the scheduler's checks find malformed (``records.record_problem``): the
loads that record would have named are unverified. Decoding checks types
but never values: a record decodes to what was encoded, or not at all,
except that lists come back as the tuples and frozensets the types name.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from engine_patch.log import get_logger
from engine_patch.types import KVChecksumRecord, KVChecksumScheduled

logger = get_logger(__name__)

# What a decoder may raise on a message that is not what it expects.
_DECODE_ERRORS = (msgspec.DecodeError, NotImplementedError, TypeError, ValueError)


def _enc_hook(obj: Any) -> Any:
    """numpy arrays as ``[dtype, shape, bytes]`` (the host's byte order: both
    ends run on one host).

    Raises:
        NotImplementedError: For object arrays and any other type msgspec
            cannot encode.

    """
    if type(obj) is np.ndarray and not obj.dtype.hasobject:
        return (obj.dtype.str, obj.shape, obj.tobytes())
    raise NotImplementedError(f"a {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    """The arrays of :func:`_enc_hook` back (read-only, over the message).

    Raises:
        NotImplementedError: For any other type.
        ValueError: If ``obj`` is not such an array.

    """
    if kind is not np.ndarray:
        raise NotImplementedError(f"a {kind.__name__}")
    try:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not an array: {e}") from None


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_SCHEDULED = msgspec.msgpack.Decoder(KVChecksumScheduled, dec_hook=_dec_hook)
_RECORD = msgspec.msgpack.Decoder(KVChecksumRecord, dec_hook=_dec_hook)


def encode_scheduled(scheduled: KVChecksumScheduled) -> bytes:
    """The step's blocks to checksum, for :func:`decode_scheduled`."""
    return _ENCODER.encode(scheduled)


def decode_scheduled(data: bytes) -> KVChecksumScheduled:
    """What :func:`encode_scheduled` encoded; nothing to checksum if ``data``
    is not that (every load the step finishes is then unverified)."""
    try:
        return _SCHEDULED.decode(data)
    except _DECODE_ERRORS:
        logger.exception("KV checksums scheduled for the step not decoded.")
        return KVChecksumScheduled()


def encode_record(record: object) -> bytes | None:
    """A worker's record for :func:`decode_record`, or None if ``record`` is
    not a :class:`KVChecksumRecord` or holds something msgpack cannot carry
    (an object array, an integer beyond 64 bits)."""
    if type(record) is not KVChecksumRecord:
        return None
    try:
        return _ENCODER.encode(record)
    except (NotImplementedError, TypeError, ValueError, OverflowError):
        return None


def decode_record(data: bytes) -> KVChecksumRecord | bytes:
    """What :func:`encode_record` encoded, or ``data`` itself if it does not
    decode to a record of the declared types."""
    try:
        return _RECORD.decode(data)
    except _DECODE_ERRORS:
        return data
