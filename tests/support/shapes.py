"""Reading answers for comparison: a JSON answer's shape (its texts
differ from engine to engine) and a stream's events."""

from __future__ import annotations

from typing import Any


def shape(value: Any) -> Any:
    """``value`` with each leaf replaced by its JSON type, and each list by
    its first item's shape (texts, token counts and ids differ)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def sse_data(raw: str) -> list[str]:
    """The data of each event of a server-sent-events body, in order (the
    final ``[DONE]`` included)."""
    return [event.removeprefix("data: ") for event in raw.split("\n\n") if event]
