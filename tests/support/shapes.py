"""Reading answers for comparison: a JSON answer's shape (its texts
differ from engine to engine) and a stream's events."""

from __future__ import annotations

from typing import Any

# Objects keyed by data, not by field names (by path, list items sharing
# their list's): a completion's top logprobs (by token text) and prompt
# logprobs (by token id).
_MAPS = frozenset(
    {"choices.logprobs.top_logprobs", "choices.prompt_logprobs", "prompt_logprobs"}
)


def shape(value: Any, path: str = "") -> Any:
    """``value`` with each leaf replaced by its JSON type, each list by its
    first item's shape, and each object keyed by data by ``{"*": its first
    value's shape}`` (texts, token counts and ids differ). An empty list or
    object in a list's first item takes its shape from the later items (a
    token whose text is empty has no bytes)."""
    if isinstance(value, dict):
        if path in _MAPS:
            return {"*": shape(next(iter(value.values())), path)} if value else {}
        prefix = f"{path}." if path else ""
        return {key: shape(item, prefix + key) for key, item in value.items()}
    if isinstance(value, list):
        if not value:
            return []
        return [filled(shape(value[0], path), [shape(v, path) for v in value[1:]])]
    return type(value).__name__


def filled(first: Any, others: list[Any]) -> Any:
    """Shape ``first`` with each empty list or object taken from the first
    of ``others`` (shapes too) with one at the same place; nothing else of
    them is taken."""
    for other in others:
        first = _filled(first, other)
    return first


def _filled(first: Any, later: Any) -> Any:
    if first in ([], {}) and type(later) is type(first):
        return later
    if isinstance(first, dict) and isinstance(later, dict):
        return {k: _filled(v, later[k]) if k in later else v for k, v in first.items()}
    if isinstance(first, list) and isinstance(later, list) and first and later:
        return [_filled(first[0], later[0])]
    return first


def sse_data(raw: str) -> list[str]:
    """The data of each event of a server-sent-events body, in order (the
    final ``[DONE]`` included)."""
    return [event.removeprefix("data: ") for event in raw.split("\n\n") if event]
