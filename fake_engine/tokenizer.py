"""The fake model's tokenizer: one token per UTF-8 byte, plus an end-of-text
token, and a plain chat template."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Token ids 0..255 are bytes; EOS ends a sequence.
EOS_TOKEN_ID = 256
VOCAB_SIZE = 257
EOS_TEXT = "</s>"


# Content parts vLLM reads as images, audio or video.
MULTIMODAL_PART_TYPES = frozenset(
    {
        "image_url",
        "image_pil",
        "image_embeds",
        "input_audio",
        "audio_url",
        "audio_embeds",
        "video_url",
        "video_embeds",
    }
)


class ChatTemplateError(ValueError):
    """A conversation the template cannot render."""


class NotMultimodalError(ChatTemplateError):
    """A message holds an image, audio or video: this model reads text only."""


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of token ids; bytes that are not valid UTF-8 become U+FFFD."""
    data = bytearray()
    text: list[str] = []
    for token_id in token_ids:
        if token_id == EOS_TOKEN_ID:
            if not skip_special_tokens:
                text.append(data.decode("utf-8", "replace") + EOS_TEXT)
                data.clear()
            continue
        data.append(token_id)
    text.append(data.decode("utf-8", "replace"))
    return "".join(text)


def _content_text(content: Any) -> str:
    """The text of a message's content: a string or a list of text parts.

    Raises:
        NotMultimodalError: If it holds an image, audio or video.
        ChatTemplateError: If it holds anything else but text.

    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else part
                if kind in MULTIMODAL_PART_TYPES:
                    raise NotMultimodalError(kind)
                raise ChatTemplateError(
                    f"Unsupported content part type {kind!r}: this model "
                    "accepts text only."
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError("A text content part needs a 'text' string.")
            parts.append(text)
        return "".join(parts)
    raise ChatTemplateError(
        f"Message content must be a string or a list of parts, "
        f"not {type(content).__name__}."
    )


def apply_chat_template(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt of a conversation: each message as ``<|role|>`` and its
    text on their own lines, then the assistant's header.

    Raises:
        NotMultimodalError: If a message holds an image, audio or video.
        ChatTemplateError: If a message has no role or other non-text
            content, if there is no message, or if both the generation
            prompt and the final message's continuation are asked for (in
            transformers' words, as vLLM answers them).

    """
    texts = [_content_text(message.get("content")) for message in messages]
    if not messages:
        raise ChatTemplateError(
            "Cannot apply chat template to an empty conversation. Provide at "
            "least one message."
        )
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt are not compatible. "
            "Use continue_final_message when you want the model to continue the "
            "final message, and add_generation_prompt when you want to add a "
            "header that will prompt it to start a new assistant message instead."
        )
    lines = []
    for i, (message, text) in enumerate(zip(messages, texts, strict=True)):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"Message {i} has no role.")
        last = i == len(messages) - 1
        if continue_final_message and last:
            lines.append(f"<|{role}|>\n{text}")
        else:
            lines.append(f"<|{role}|>\n{text}\n")
    if add_generation_prompt:
        lines.append("<|assistant|>\n")
    return "".join(lines)
