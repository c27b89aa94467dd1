"""The shape of a JSON answer, for comparing answers whose texts differ."""

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
