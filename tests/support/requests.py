"""Hypothesis strategies for the request bodies clients post to vLLM's
OpenAI routes: valid ones, and any JSON in their fields."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Any JSON value, in the shapes of request fields' values.
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-2, 40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "hi", "user", "assistant", "auto", "m0"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "include_usage"]),
            inner,
            max_size=3,
        )
    ),
    max_leaves=10,
)
# Values vLLM accepts for its fields, and any value for any of them. Both
# routes' prompt fields are always there: each route ignores the other's.
_PROMPTS = {
    "prompt": st.sampled_from(["hi", ["hi"], [1, 2]]),
    "messages": st.just([{"role": "user", "content": "hi"}]),
}
_FIELDS = {
    "max_tokens": st.integers(1, 4),
    "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}),
    "n": st.integers(1, 2),
    "echo": st.booleans(),
    "logprobs": st.none(),
    "min_tokens": st.integers(0, 1),
    "return_token_ids": st.booleans(),
}
_VALID = st.fixed_dictionaries(_PROMPTS, optional=_FIELDS)
_BODIES = (
    _VALID
    | st.builds(
        lambda body, key, value: {**body, key: value},
        _VALID,
        st.sampled_from([*_PROMPTS, *_FIELDS, "model", "kv_transfer_params"]),
        _VALUES,
    )
    | st.fixed_dictionaries({}, optional=dict.fromkeys([*_PROMPTS, *_FIELDS], _VALUES))
)


def request_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """Bodies for either route: vLLM's fields with values it accepts (both
    routes' prompt fields: each route ignores the other's), one field with
    any value, or any values."""
    return _BODIES
