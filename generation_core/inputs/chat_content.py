"""A chat message's content as the text a chat template reads.

Datasets and API requests give content as a string or as OpenAI-style content parts
(`[{"type": "text", "text": ...}, ...]`). Text parts are joined in order (tasks and the OpenAI batch
reader alike); anything else (an image or audio part, null content, a number) has no text form a
chat template would read the same way, so it is refused rather than written as its Python repr.
A pure function, so every reader of chat messages can share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class NotText(ValueError):
    """Content that is not text: the message says what it is, for the caller to place (file, row)."""


def content_text(content: Any) -> str:
    """`content` as one string: a string as it is, a list of text parts joined; NotText otherwise."""
    if isinstance(content, str):
        return content
    if content is None:
        raise NotText("content is null")
    if isinstance(content, list):
        if not content:
            raise NotText("content is an empty list of parts")
        texts = []
        for position, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"a {kind!r} part" if kind is not None else f"a {type(part).__name__}"
                raise NotText(
                    f"content[{position}] is {what}; only text parts ({{'type': 'text', 'text': ...}}) are supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise NotText(f"content is a {type(content).__name__}, not text or a list of text parts")
