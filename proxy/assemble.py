"""A non-streaming reply assembled from the decode's stream.

The proxy decodes a non-streaming request as a stream so that the decode's
first token bounds a hung KV load (``timeouts.decode_first_token_s``), as it
does for a client's stream. The client still gets one JSON reply: the chunks'
deltas merged per choice, text concatenated, as vLLM's non-streaming reply
carries them. Fields vLLM 0.32's JSON reply sets to null and its stream
never sends (``kv_transfer_params``, ``service_tier``, a message's
``refusal`` and the like) are added as null, so the reply has the keys a
single vLLM's has.

vLLM's completions stream carries the prompt's token ids in the first chunk
for ``echo`` as well as for ``return_token_ids``; its non-streaming reply
only for ``return_token_ids``.
"""

from __future__ import annotations

from typing import Any

# String fields whose deltas are pieces of one text; other strings (ids,
# roles, finish reasons, tool names) are whole values, the last one kept.
_PIECES = frozenset(
    {"text", "content", "reasoning", "reasoning_content", "arguments", "refusal"}
)

_OBJECT = {"chat.completion.chunk": "chat.completion"}

# Per reply object: the null fields vLLM 0.32 puts in a non-streaming reply
# and leaves out of its stream's chunks, at the top, in each choice and in a
# chat choice's message.
_NULL_ONLY: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "text_completion": (
        ("service_tier", "kv_transfer_params", "ec_transfer_params", "metrics"),
        ("prompt_logprobs", "routed_experts"),
        (),
    ),
    "chat.completion": (
        ("service_tier", "prompt_logprobs", "kv_transfer_params",
         "ec_transfer_params", "metrics"),
        ("routed_experts",),
        ("refusal", "annotations", "audio", "function_call", "reasoning"),
    ),
}  # fmt: skip
_USAGE_NULL_ONLY = ("prompt_tokens_details", "completion_tokens_details")


class Assembler:
    """Merges stream chunks (parsed ``data:`` events) into one reply."""

    __slots__ = ("_choices", "_prompt_token_ids", "_top")

    def __init__(self, *, prompt_token_ids: bool = True) -> None:
        """``prompt_token_ids``: the client asked for them
        (``return_token_ids``); else the reply's choices carry null."""
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self._prompt_token_ids = prompt_token_ids

    def feed(self, chunk: dict[str, Any]) -> None:
        """Adds one chunk; chunks come in stream order.

        Raises:
            ValueError: If its ``choices`` is not an array (nor null), a
                choice's ``index`` is not an integer (choices could not be
                told apart) or a chat choice's ``message`` is not an object;
                the chunk may be partly added.

        """
        for key, value in chunk.items():
            if key == "choices":
                if type(value) is list:
                    for choice in value:
                        if type(choice) is dict:
                            self._choice(choice)
                elif value is not None:
                    raise ValueError("its choices are not an array")
            elif value is not None or key not in self._top:
                self._top[key] = value

    def _choice(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", 0)
        if type(index) is not int:
            raise ValueError("a choice's index is not an integer")
        into = self._choices.get(index)
        if into is None:
            into = self._choices[index] = {}
        for key, value in delta.items():
            if key == "delta":  # chat: the message's pieces
                message = into.setdefault("message", {})
                if type(message) is not dict:
                    raise ValueError("a choice's message is not an object")
                if type(value) is dict:
                    _merge(message, value)
            # _merge_item's commonest cases inline: a choice's null fields,
            # a first scalar (its copy is itself) and a piece of text.
            elif value is None:
                into.setdefault(key, None)
            else:
                old = into.get(key)
                if old is None and not isinstance(value, (dict, list)):
                    into[key] = value
                elif key in _PIECES and isinstance(value, str) and isinstance(old, str):
                    into[key] = old + value
                else:
                    _merge_item(into, key, value)

    def result(self) -> dict[str, Any]:
        """The assembled reply, shaped like vLLM's non-streaming one."""
        reply = dict(self._top)
        obj = reply.get("object")
        if isinstance(obj, str):
            obj = reply["object"] = _OBJECT.get(obj, obj)
        reply["choices"] = choices = [self._choices[i] for i in sorted(self._choices)]
        if not self._prompt_token_ids:
            for choice in choices:
                if choice.get("prompt_token_ids") is not None:
                    choice["prompt_token_ids"] = None
        null_only = _NULL_ONLY.get(obj) if isinstance(obj, str) else None
        if null_only is not None:
            top, per_choice, per_message = null_only
            for key in top:
                reply.setdefault(key, None)
            for choice in choices:
                for key in per_choice:
                    choice.setdefault(key, None)
                message = choice.get("message")
                if isinstance(message, dict):
                    for key in per_message:
                        message.setdefault(key, None)
        if "usage" in reply:  # vLLM puts it after the choices
            usage = reply["usage"] = reply.pop("usage")
            if isinstance(usage, dict):
                for key in _USAGE_NULL_ONLY:
                    usage.setdefault(key, None)
        return reply


def _merge(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """Merges one delta into ``into``, key by key (see ``_merge_item``)."""
    for key, value in delta.items():
        _merge_item(into, key, value)


def _merge_item(into: dict[str, Any], key: str, value: Any) -> None:
    """Merges one delta's ``key`` into ``into``: pieces of text join, lists
    extend (tool calls merge by their ``index``), nested objects merge, other
    values replace unless null.

    A function per key, not per delta: a choice's fields (about ten a
    chunk, per token) are merged without a one-key dict each.
    """
    old = into.get(key)
    if value is None:
        into.setdefault(key, None)
    elif old is None:
        into[key] = _copy(value)
    elif isinstance(value, str) and isinstance(old, str) and key in _PIECES:
        into[key] = old + value
    elif isinstance(value, list) and isinstance(old, list):
        if key == "tool_calls":
            _merge_indexed(old, value)
        else:
            old.extend(_copy(value))
    elif isinstance(value, dict) and isinstance(old, dict):
        _merge(old, value)
    else:
        into[key] = _copy(value)


def _merge_indexed(into: list[Any], items: list[Any]) -> None:
    """Tool call deltas: each names the call it continues by ``index``."""
    for item in items:
        if isinstance(item, dict) and "index" in item:
            for old in into:
                if isinstance(old, dict) and old.get("index") == item["index"]:
                    _merge(old, item)
                    break
            else:
                into.append(_copy(item))
        else:
            into.append(_copy(item))


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
