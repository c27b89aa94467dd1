"""Whatever a prefill answers or a decode streams, the proxy answers its
client: a reply, or an error in OpenAI JSON that says which leg failed, never
an internal error."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from proxy_helpers import StubEngine, one_attempt

# Keys vLLM's chunks use, so that generated objects reach the merging code.
_KEYS = st.sampled_from(
    [
        "id",
        "object",
        "choices",
        "index",
        "text",
        "delta",
        "message",
        "content",
        "role",
        "tool_calls",
        "function",
        "arguments",
        "logprobs",
        "token_ids",
        "prompt_token_ids",
        "finish_reason",
        "usage",
        "error",
    ]
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "a", "abort", "stop", "chat.completion.chunk"])
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4)
    ),
    max_leaves=12,
)
# Chunk-like objects: mostly a list of choice-like objects, or anything.
_CHUNKS = st.fixed_dictionaries(
    {},
    optional={
        "id": _JSON,
        "object": _JSON,
        "choices": st.lists(st.dictionaries(_KEYS, _JSON, max_size=5), max_size=2)
        | _JSON,
        "usage": _JSON,
        "error": _JSON,
        "kv_transfer_params": _JSON
        | st.dictionaries(
            st.sampled_from(["do_remote_prefill", "remote_block_ids", "kv_checksums"]),
            _JSON,
        ),
    },
)
_EVENTS = st.lists(
    st.one_of(
        _CHUNKS.map(msgspec.json.encode),
        _JSON.map(msgspec.json.encode),
        st.binary(max_size=8).filter(lambda b: b"\n" not in b and b"\r" not in b),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(events=_EVENTS, stream=st.booleans())
async def test_a_decode_streaming_anything_gets_a_reply_or_a_decode_failure(
    events: list[bytes], stream: bool
) -> None:
    status, _, body = await one_attempt(
        StubEngine(),
        StubEngine(events=events),
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "stream": stream},
    )
    assert status in (200, 502, 503), body
    if status != 200:
        assert "decode" in msgspec.json.decode(body)["error"]["message"]
    elif not stream:
        assert isinstance(msgspec.json.decode(body)["choices"], list)


@settings(max_examples=150, deadline=None)
@given(
    reply=_CHUNKS.map(msgspec.json.encode)
    | _JSON.map(msgspec.json.encode)
    | st.binary(max_size=8),
    stream=st.booleans(),
)
async def test_a_prefill_answering_anything_gets_a_reply_or_a_prefill_failure(
    reply: bytes, stream: bool
) -> None:
    status, _, body = await one_attempt(
        StubEngine(prefill_reply=reply),
        StubEngine(),
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 4, "stream": stream},
    )
    assert status in (200, 502, 503), body
    if status != 200:
        assert "prefill" in msgspec.json.decode(body)["error"]["message"]
