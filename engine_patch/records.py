"""Checks of the worker reports the scheduler takes (``KVChecksumRecord``):
a worker of another build, a connector passing a peer's message, or a bug
may hand it anything, and nothing it is handed may raise out of it. A
malformed report leaves the loads it names unverified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine_patch.types import KVChecksumGroup, KVChecksumRecord

_U64 = 1 << 64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_keyed(value: object) -> bool:
    return isinstance(value, Mapping) and all(_is_int(key) for key in value)


def record_problem(record: object, *, tp_size: int, pp_size: int) -> str | None:
    """Why a record as a whole is malformed, or None: its worker's ranks are
    out of range, or a field has the wrong type. (The checksums of each
    request are checked by :func:`checksums_problem`.)"""
    if not isinstance(record, KVChecksumRecord):
        return f"not a checksum record: {type(record).__name__}"
    pp_rank, tp_rank = record.pp_rank, record.tp_rank
    if not (_is_int(pp_rank) and _is_int(tp_rank)):
        return f"ranks {pp_rank!r}, {tp_rank!r} are not integers"
    if not (0 <= pp_rank < pp_size and 0 <= tp_rank < tp_size):
        return f"no worker ({pp_rank}, {tp_rank}) in PP {pp_size}, TP {tp_size}"
    if not isinstance(record.checksums, Mapping) or not all(
        isinstance(req_id, str) for req_id in record.checksums
    ):
        return "checksums are not keyed by request id"
    skipped = record.skipped_groups
    if not isinstance(skipped, (set, frozenset)) or not all(map(_is_int, skipped)):
        return "skipped groups are not a set of group ids"
    fingerprints = record.fingerprints
    if not _is_int_keyed(fingerprints) or not all(
        _is_int(fp) and 0 <= fp < _U64 for fp in fingerprints.values()
    ):
        return "fingerprints are not 64-bit integers per group id"
    received = record.received
    if not isinstance(received, Mapping) or not all(
        isinstance(req_id, str) for req_id in received
    ):
        return "received checksums are not keyed by request id"
    return None


def requests_named(record: object) -> list[str]:
    """The request ids a (possibly malformed) record has checksums of, as
    far as it can tell."""
    checksums = getattr(record, "checksums", None)
    if not isinstance(checksums, Mapping):
        return []
    return [req_id for req_id in checksums if isinstance(req_id, str)]


def checksums_problem(groups: object, *, tp_size: int) -> str | None:
    """Why one request's checksums in a record are malformed, or None.

    Per group id, a :class:`KVChecksumGroup` whose ``start`` is a natural
    number, whose replica keys are distinct ``(replicas, index)`` pairs with
    ``1 <= replicas <= tp_size`` and ``index < replicas``, whose ``values``
    are uint64 ``[spans, len(replica_keys)]`` and whose ``stored`` is None or
    uint64 ``[blocks]``. Shapes against the scheduled blocks are checked
    where the group is compared.
    """
    if not _is_int_keyed(groups):
        return "checksums are not keyed by group id"
    assert isinstance(groups, Mapping)
    for group_id, group in groups.items():
        if (problem := _group_problem(group, tp_size)) is not None:
            return f"group {group_id}: {problem}"
    return None


def _group_problem(group: object, tp_size: int) -> str | None:
    if not isinstance(group, KVChecksumGroup):
        return f"not checksums of a group: {type(group).__name__}"
    if not _is_int(group.start) or group.start < 0:
        return f"start {group.start!r}"
    keys: Any = group.replica_keys
    if not isinstance(keys, list) or not all(
        isinstance(key, tuple)
        and len(key) == 2
        and _is_int(key[0])
        and _is_int(key[1])
        and 1 <= key[0] <= tp_size
        and 0 <= key[1] < key[0]
        for key in keys
    ):
        return f"replica keys {keys!r}"
    if len(set(keys)) != len(keys):
        return f"repeated replica keys {keys!r}"
    values = group.values
    if not _is_uint64(values, 2) or values.shape[1] != len(keys):
        return f"values {_describe(values)} for {len(keys)} replica keys"
    stored = group.stored
    if stored is not None and not _is_uint64(stored, 1):
        return f"stored values {_describe(stored)}"
    return None


def _is_uint64(array: object, ndim: int) -> bool:
    return (
        isinstance(array, np.ndarray)
        and array.dtype == np.uint64
        and array.ndim == ndim
    )


def _describe(array: object) -> str:
    if isinstance(array, np.ndarray):
        return f"{array.dtype}{list(array.shape)}"
    return type(array).__name__
