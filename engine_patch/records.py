"""Checks of the worker reports the scheduler takes (``KVChecksumRecord``):
a worker of another build, a connector passing a peer's message, or a bug
may hand it anything, and nothing it is handed may raise out of it. A
malformed report leaves the loads it names unverified.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_patch.types import KVChecksumGroup, KVChecksumRecord

_U64 = 1 << 64
_UINT64 = np.dtype(np.uint64)

# Exact types: checked on every record of every step, so no ABC lookups;
# ``type(x) is int`` also refuses bools.


def _is_int(value: object) -> bool:
    return type(value) is int


def _all_str(keys: dict[Any, Any]) -> bool:
    return all(type(key) is str for key in keys)


def record_problem(record: object, *, tp_size: int, pp_size: int) -> str | None:
    """Why a record as a whole is malformed, or None: its worker's ranks are
    out of range, or a field has the wrong type or is missing (unpickled from
    another build). (The checksums of each request are checked by
    :func:`checksums_problem`.)"""
    if type(record) is not KVChecksumRecord:
        return f"not a checksum record: {type(record).__name__}"
    try:
        return _record_fields_problem(record, tp_size, pp_size)
    except AttributeError as e:
        return f"no field {e.name!r}"


def _record_fields_problem(
    record: KVChecksumRecord, tp_size: int, pp_size: int
) -> str | None:
    pp_rank, tp_rank = record.pp_rank, record.tp_rank
    if not (_is_int(pp_rank) and _is_int(tp_rank)):
        return f"ranks {pp_rank!r}, {tp_rank!r} are not integers"
    if not (0 <= pp_rank < pp_size and 0 <= tp_rank < tp_size):
        return f"no worker ({pp_rank}, {tp_rank}) in PP {pp_size}, TP {tp_size}"
    checksums = record.checksums
    if type(checksums) is not dict or not _all_str(checksums):
        return "checksums are not keyed by request id"
    skipped = record.skipped_groups
    if type(skipped) not in (set, frozenset) or not all(map(_is_int, skipped)):
        return "skipped groups are not a set of group ids"
    fingerprints = record.fingerprints
    if type(fingerprints) is not dict:
        return "fingerprints are not 64-bit integers per group id"
    for group_id, fingerprint in fingerprints.items():
        if not (
            type(group_id) is int
            and type(fingerprint) is int
            and 0 <= fingerprint < _U64
        ):
            return "fingerprints are not 64-bit integers per group id"
    received = record.received
    if type(received) is not dict or not _all_str(received):
        return "received checksums are not keyed by request id"
    return None


def requests_named(record: object) -> list[str]:
    """The request ids a (possibly malformed) record has checksums of, as
    far as it can tell."""
    checksums = getattr(record, "checksums", None)
    if type(checksums) is not dict:
        return []
    return [req_id for req_id in checksums if type(req_id) is str]


def checksums_problem(groups: object, *, tp_size: int) -> str | None:
    """Why one request's checksums in a record are malformed, or None.

    Per group id, a :class:`KVChecksumGroup` whose ``start`` is a natural
    number, whose replica keys are distinct ``(replicas, index)`` pairs with
    ``1 <= replicas <= tp_size`` and ``index < replicas``, whose ``values``
    are uint64 ``[spans, len(replica_keys)]`` and whose ``stored`` is None or
    uint64 ``[blocks]``. Shapes against the scheduled blocks are checked
    where the group is compared.
    """
    if type(groups) is not dict:
        return "checksums are not keyed by group id"
    for group_id, group in groups.items():
        if not _is_int(group_id):
            return "checksums are not keyed by group id"
        if (problem := _group_problem(group, tp_size)) is not None:
            return f"group {group_id}: {problem}"
    return None


def _group_problem(group: object, tp_size: int) -> str | None:
    if type(group) is not KVChecksumGroup:
        return f"not checksums of a group: {type(group).__name__}"
    try:
        return _group_fields_problem(group, tp_size)
    except AttributeError as e:
        return f"no field {e.name!r}"


def _group_fields_problem(group: KVChecksumGroup, tp_size: int) -> str | None:
    if not _is_int(group.start) or group.start < 0:
        return f"start {group.start!r}"
    keys: Any = group.replica_keys
    if type(keys) is not list:
        return f"replica keys {keys!r}"
    for key in keys:
        if not (
            type(key) is tuple
            and len(key) == 2
            and type(key[0]) is int
            and type(key[1]) is int
            and 1 <= key[0] <= tp_size
            and 0 <= key[1] < key[0]
        ):
            return f"replica keys {keys!r}"
    if len(keys) > 1 and len(set(keys)) != len(keys):
        return f"repeated replica keys {keys!r}"
    values = group.values
    if not _is_uint64(values, 2) or values.shape[1] != len(keys):
        return f"values {_describe(values)} for {len(keys)} replica keys"
    stored = group.stored
    if stored is not None and not _is_uint64(stored, 1):
        return f"stored values {_describe(stored)}"
    return None


def _is_uint64(array: object, ndim: int) -> bool:
    return type(array) is np.ndarray and array.dtype == _UINT64 and array.ndim == ndim


def _describe(array: object) -> str:
    if isinstance(array, np.ndarray):
        return f"{array.dtype}{list(array.shape)}"
    return type(array).__name__
