"""Chat messages as a chat template reads them: the one rule every reader of chat messages shares.

Datasets and API requests give content as a string or as OpenAI-style content parts
(`[{"type": "text", "text": ...}, ...]`). `content_text` says which content shapes are accepted:
text parts are joined in order; anything else (an image or audio part, null content, a number)
has no text form a chat template would read the same way, so it is refused rather than written
as its Python repr; image parts only where the caller gives the images (a vision-language model's
rows), as verl's `<image>` placeholder. `checked_message` adds the role (a string) and is what a dataset row's
messages must pass as they are (inputs/chat_rows.py). `prompt_message` is the stricter rule of
the prompts genrun builds itself (tasks' `chat_messages`, OpenAI batch lines): a role a chat
template renders (`ROLES`), no tool calls, and the message's `name` kept.
Pure functions: the callers place a refusal (file, row, line).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""The roles a prompt genrun builds may hold, as the chat template gets them: open models'
templates know system, not OpenAI's newer developer role; tool (and the legacy function) messages
answer tool calls, which such prompts do not carry."""


class BadMessage(ValueError):
    """A message a chat template cannot read as it is. The text continues the message's place
    (`messages[1]` + `.content is null`, ` is not a message with a role`) for the caller to give."""


class NotText(BadMessage):
    """Content that is not text: the message says what it is (`content is null`)."""


IMAGE_PLACEHOLDER = "<image>"
"""verl's RLHFDataset splits string content on it and puts the row's next image there."""


def content_text(content: Any, image_parts: tuple[str, ...] = ()) -> str:
    """`content` as one string: a string as it is, a list of text parts joined; NotText otherwise.
    The one statement of the content shapes genrun accepts. `image_parts`: the part types that
    stand for an image where the caller gives the images (a vision-language model's rows with
    images): each becomes IMAGE_PLACEHOLDER, so the text is verl's `<image>` layout, and a text
    part holding the placeholder itself is refused (verl would count it as one more image)."""
    if isinstance(content, str):
        return content
    if content is None:
        raise NotText("content is null")
    if isinstance(content, list):
        if not content:
            raise NotText("content is an empty list of parts")
        return "".join(_part_text(position, part, image_parts) for position, part in enumerate(content))
    kind = type(content).__name__
    raise NotText(f"content is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not text or a list of text parts")


def _part_text(position: int, part: Any, image_parts: tuple[str, ...]) -> str:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in image_parts and isinstance(part, Mapping):
        inline = sorted(key for key, value in part.items() if key not in ("type", "text") and value is not None)
        if kind == "image" and inline:
            raise NotText(
                f"content[{position}] is an image part with its own {inline[0]!r}; a row's images come from its "
                "images column: give {'type': 'image'} parts, one per image, in order"
            )
        return IMAGE_PLACEHOLDER
    if kind != "text" or not isinstance(part.get("text"), str):
        what = f"a {kind!r} part" if kind is not None else f"a {type(part).__name__}"
        raise NotText(f"content[{position}] is {what}; only text parts ({{'type': 'text', 'text': ...}}) are supported")
    if image_parts and IMAGE_PLACEHOLDER in part["text"]:
        raise NotText(
            f"content[{position}] holds {IMAGE_PLACEHOLDER!r} in its text beside image parts, which verl would read as "
            "one more image; give each image as an image part"
        )
    return part["text"]


def checked_message(message: Any, image_parts: tuple[str, ...] = ()) -> tuple[str, str]:
    """(role, content as text) of a message: a mapping with a non-empty string role and content
    `content_text` accepts (with `image_parts`); BadMessage otherwise."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or not message["role"]:
        raise BadMessage(" is not a message with a role")
    try:
        return message["role"], content_text(message.get("content"), image_parts)
    except NotText as not_text:
        raise NotText(f".{not_text}") from None


def prompt_message(message: Any, image_parts: tuple[str, ...] = ()) -> dict[str, str]:
    """A message of a prompt genrun builds: its role as the template gets it (`ROLES`; others
    refused), its content as text, its `name` when it has one; a message with tool calls is
    refused (a prompt of text messages would drop them). BadMessage for what it cannot be."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise BadMessage(" is not a message with a role")
    if message["role"] not in ROLES:
        raise BadMessage(
            f".role {message['role']!r} is not one a chat template renders; use system, developer, user or assistant"
        )
    if message.get("tool_calls"):
        raise BadMessage(" has tool_calls, which a prompt of text messages would drop; give text messages")
    role, text = checked_message(message, image_parts)
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise BadMessage(".name must be text")
    return {"role": ROLES[role], "content": text, **({} if name is None else {"name": name})}
