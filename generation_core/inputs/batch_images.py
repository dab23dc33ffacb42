"""The images of an OpenAI batch line (inputs/openai_batch.py): its `image_url` parts read into
`{"bytes": ...}` cells of the rows' `images` column, in order, for a vision-language model; each
part stands in its message's text as verl's `<image>` (chat_content.content_text), so the row is in
verl's placeholder layout (docs/multimodal.md). A part for a text-only model, an image that does
not read or open, or a line whose own text holds `<image>` beside its parts is refused
(`BadImage`, placed by the caller on the line). A data URL's bytes are never quoted, and a URL's
credentials are masked.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pyarrow as pa

from generation_core.inputs.chat_content import IMAGE_PLACEHOLDER
from generation_core.inputs.images import image_problem, read_image_source
from generation_core.inputs.vl_processor import model_type
from generation_core.secrets import without_url_credentials

IMAGES = pa.list_(pa.struct([pa.field("bytes", pa.binary())]))
"""The rows' `images` column of a batch file with image parts."""


class BadImage(ValueError):
    """An image part a run cannot take: the text says which and why."""


def message_images(message: Any, where: str, model: str | None) -> list[dict[str, bytes]]:
    """The images of a message's `image_url` parts (chat_content accepted its shape), each read
    and checked to open. `where`: the message's place (`body.messages[0]`); `model`: the run's
    model path, checked to be a vision-language model (None: not checked, as a shard rereads)."""
    content = message.get("content")
    parts = [
        (position, part)
        for position, part in enumerate(content if isinstance(content, list) else [])
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]
    if not parts:
        return []
    kind = None if model is None else _text_only_kind(model)
    if kind is not None:
        raise BadImage(
            f"{where}.content has image_url parts, and the model {model} is a text-only {kind} model: images "
            "need a vision-language model (e.g. Qwen2.5-VL); set actor_rollout_ref.model.path to one, or remove them"
        )
    return [_part_image(part, f"{where}.content[{position}].image_url") for position, part in parts]


def _part_image(part: dict[str, Any], place: str) -> dict[str, bytes]:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise BadImage(f"{place} must be {{'url': ...}} (a data:image/...;base64, URL, a path or a URL)")
    named = "its data URL" if url.startswith("data:") else f"{without_url_credentials(url)!r}"
    try:
        data = read_image_source(url)
    except (OSError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise BadImage(f"{place}: {named} does not read ({without_url_credentials(reason)})") from None
    problem = image_problem({"bytes": data})
    if problem is not None:
        raise BadImage(f"{place}: {named} {problem}")
    return {"bytes": data}


def placeholder_problem(prompt: list[dict[str, Any]], images: int) -> str | None:
    """Why a line's converted messages (`<image>` where its parts were) do not pair with its
    `images` images (text of its own holding `<image>`); None when they do or it has none."""
    placeholders = sum(str(message["content"]).count(IMAGE_PLACEHOLDER) for message in prompt)
    if not images or placeholders == images:
        return None
    return (
        f"body.messages hold {placeholders - images} {IMAGE_PLACEHOLDER!r} in their text beside "
        f"{images} image_url part(s), which verl would read as more images; remove it from the text"
    )


@functools.cache
def _text_only_kind(model: str) -> str | None:
    """The model type of a text-only model folder, None for a vision-language one."""
    kind, vision = model_type(os.path.expanduser(model))
    return None if vision else kind
