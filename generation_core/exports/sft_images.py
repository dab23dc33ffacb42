"""The SFT export of a run with images, in the layout TRL's SFTTrainer reads for a vision-language
model: each message's content a list of parts (`{"type": "image"}` where the prompt had an image,
`{"type": "text", "text": ...}` for its text and for every other turn), and an `images` column
holding the trajectory's images in the order of the image parts, as Hugging Face `datasets`
images (`{"bytes": PNG, "path": null}` cells, declared `Image` in the file's schema metadata, so
`load_dataset("parquet", ...)` gives PIL images, which TRL hands the processor).

The images are the ones the model saw: the resized PNG each part stores (docs/multimodal.md), on
the model's patch grid already, so the processor's own resize keeps them as they are. A run whose
parts hold no image is exported as before, with string contents and no `images` column.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from generation_core.exports.key_order import PartKeys

PART = pa.struct([pa.field("type", pa.string()), pa.field("text", pa.string())])
PART_MESSAGES = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.list_(PART))]))
IMAGES = pa.list_(pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())]))
IMAGE_FEATURES = {"images": {"_type": "Sequence", "feature": {"_type": "Image"}}}
"""The `images` column as a `datasets` feature (a list of Image), in the schema metadata `datasets` reads."""
MESSAGE_COLUMNS = ("messages", "prompt", "completion")


def run_has_images(keyed: list[PartKeys]) -> bool:
    """Whether a committed row of the run has images (key_order.part_keys notes it per part)."""
    return any(keyed_part.with_images for keyed_part in keyed)


def with_image_fields(schema: pa.Schema) -> pa.Schema:
    """The text export's schema with content-part messages and the `images` column after them."""
    fields = [pa.field(f.name, PART_MESSAGES) if f.name in MESSAGE_COLUMNS else f for f in schema]
    last_message = max(i for i, f in enumerate(fields) if f.name in MESSAGE_COLUMNS)
    fields.insert(last_message + 1, pa.field("images", IMAGES))
    return pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": IMAGE_FEATURES}})})


def content_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with every content as a list of {"type", "text"} parts: a string is one text part,
    an image part is `{"type": "image"}` (text null)."""
    converted: list[dict[str, Any]] = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            parts: list[dict[str, str | None]] = [{"type": "text", "text": content}]
        else:
            parts = [
                {"type": "text", "text": part.get("text")}
                if part.get("type") == "text"
                else {"type": "image", "text": None}
                for part in content
            ]
        converted.append({"role": message["role"], "content": parts})
    return converted


def image_row(row: dict[str, Any], images: list[bytes] | None) -> dict[str, Any]:
    """An export row (export._row) in the image layout: content parts, and its images (none: [])."""
    for name in MESSAGE_COLUMNS:
        if name in row:
            row[name] = content_parts(row[name])
    row["images"] = [{"bytes": data, "path": None} for data in images or []]
    return row
