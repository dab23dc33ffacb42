"""Images in chat messages, read the way verl's agent loops read them, without torchvision.

verl's RLHFDataset turns a row's `<image>` placeholders and its `data.image_key` column into
image parts of the chat messages (`{"type": "image", "image": PIL image}` for a `{"bytes": ...}`
cell, `{"type": "image", "image": path}` for a path or URL, `{"type": "image", **cell}` for
another dict), and its agent loops fetch and resize each part with qwen_vl_utils'
`fetch_image` before the processor sees it. qwen_vl_utils imports torchvision at its top, which
does not import on this machine: `vision_info` is that function's rule for images (a PIL image,
a local path, a `file://`, fsspec or http URL, a `data:image/...;base64,` URL; RGB on white;
`smart_resize` to the `min_pixels`/`max_pixels` the part names, else 4 to 16384 tokens of
`image_patch_size * 2` pixels; bicubic resize), so genrun's shards hand verl's agent loop
the images qwen_vl_utils would. A video part is refused in one line (`VideoNeedsTorchvision`).

What a trajectory keeps of its images (`stored_images`): each resized image as PNG (lossless,
so the merge rebuilds exactly the pixels verl's postprocess saw), and the messages with each
image part reduced to `{"type": "image"}` (JSON has no image type).
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
from collections.abc import Mapping
from typing import Any

from generation_core.inputs.vl_processor import VideoNeedsTorchvision

SPATIAL_MERGE_SIZE = 2
IMAGE_MIN_TOKEN_NUM = 4
IMAGE_MAX_TOKEN_NUM = 16384
MAX_RATIO = 200
"""qwen_vl_utils 0.0.14's constants (vision_process.py)."""
IMAGE_PART_TYPES = ("image", "image_url")
"""The content-part types that carry an image (verl's VL token builder reads both)."""


def vision_info(messages: list[dict], image_patch_size: int = 14) -> tuple[list[Any] | None, None]:
    """(images, videos) of the messages as qwen_vl_utils' `process_vision_info` gives them for
    images: every image part fetched and resized in order; None when there is none."""
    images = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            if part.get("type") == "video" or "video" in part:
                raise VideoNeedsTorchvision(
                    "a video part reached the agent loop, and genrun reads videos only with torchvision, which does "
                    "not import on this machine: give images only"
                )
            if part.get("type") in IMAGE_PART_TYPES or "image" in part or "image_url" in part:
                images.append(fetch_image(part, image_patch_size))
    return images or None, None


def fetch_image(part: Mapping[str, Any], image_patch_size: int = 14):
    """qwen_vl_utils' `fetch_image`: the part's image opened, as RGB, resized to the grid."""
    from PIL import Image

    source = next((part[key] for key in ("image", "image_url", "path") if part.get(key) is not None), None)
    if isinstance(source, Mapping):
        source = source.get("url")
    image = source if isinstance(source, Image.Image) else Image.open(io.BytesIO(read_image_source(source)))
    image = _to_rgb(image)
    factor = image_patch_size * SPATIAL_MERGE_SIZE
    if "resized_height" in part and "resized_width" in part:
        height, width = smart_resize(int(part["resized_height"]), int(part["resized_width"]), factor)
    else:
        width, height = image.size
        height, width = smart_resize(
            height,
            width,
            factor,
            part.get("min_pixels", IMAGE_MIN_TOKEN_NUM * factor**2),
            part.get("max_pixels", IMAGE_MAX_TOKEN_NUM * factor**2),
        )
    return image.resize((width, height))


def read_image_source(source: Any) -> bytes:
    """The bytes an image reference names: a `data:image/...;base64,` URL, a `file://` URL, any
    URL fsspec opens (http(s), s3, gs, ...) or a local path."""
    if not isinstance(source, str):
        raise ValueError(f"an image must be a PIL image, a path or a URL, not a {type(source).__name__}")
    if source.startswith("data:image"):
        if "base64," not in source:
            raise ValueError("a data: image URL must be base64 (data:image/...;base64,...)")
        return base64.b64decode(source.split("base64,", 1)[1])
    import fsspec

    with fsspec.open(source[len("file://") :] if source.startswith("file://") else source, "rb") as handle:
        return handle.read()


def smart_resize(height: int, width: int, factor: int, min_pixels: int | None = None, max_pixels: int | None = None):
    """qwen_vl_utils' `smart_resize`: (height, width), each a multiple of `factor`, their product
    within [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    max_pixels = max_pixels if max_pixels is not None else IMAGE_MAX_TOKEN_NUM * factor**2
    min_pixels = min_pixels if min_pixels is not None else IMAGE_MIN_TOKEN_NUM * factor**2
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_RATIO}, got {max(height, width) / min(height, width)}"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _to_rgb(image):
    from PIL import Image

    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def png_bytes(image) -> bytes:
    """A PIL image as PNG (lossless)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def open_png(data: bytes):
    """`png_bytes` read back: the same RGB pixels."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def stored_messages(messages: Any) -> Any:
    """The chat messages as a trajectory keeps them: each image part as `{"type": "image"}` (its
    pixels are kept apart, once per prompt); text parts and string content as they are."""
    if not isinstance(messages, list):
        return messages
    kept = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts = [
                {"type": "image"}
                if isinstance(part, Mapping)
                and (part.get("type") in IMAGE_PART_TYPES or "image" in part or "image_url" in part)
                else part
                for part in content
            ]
            message = dict(message, content=parts)
        kept.append(message)
    return kept


def image_slots(messages: Any) -> int:
    """How many images the messages take: `<image>` placeholders in string content (verl's
    RLHFDataset splits on them) and image parts of content lists."""
    count = 0
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            count += content.count("<image>")
        elif isinstance(content, list):
            count += sum(
                isinstance(part, Mapping) and (part.get("type") in IMAGE_PART_TYPES or "image" in part)
                for part in content
            )
    return count


def slots_problem(slots: int, images: int, column: str = "images") -> str:
    """How a prompt whose image slots (`image_slots`) do not match its row's images is refused,
    as the end of a sentence naming the prompt (verl's RLHFDataset pairs them in order)."""
    return (
        f" has {slots} image placeholder(s) (<image> in the text, or image parts) for {images} image(s) in "
        f"{column!r}; give one placeholder per image, in order"
    )


def image_problem(cell: Any) -> str | None:
    """What keeps an image cell of a dataset row (`{"bytes": ...}`, `{"path": ...}`, `{"image": ...}`
    or a path/URL string) from opening, as the end of a sentence; None when it opens."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(cell, Mapping):
        if "bytes" in cell and cell["bytes"] is None and cell.get("path") is not None:
            # verl's RLHFDataset opens cell["bytes"] whenever the key is there.
            return "has bytes: null beside its path; give the image's bytes, or the path alone ({'path': ...})"
        data = cell.get("bytes")
        source = cell.get("path") or cell.get("image") or cell.get("image_url")
    else:
        data, source = None, cell
    try:
        if data is None:
            if source is None:
                return "has neither bytes nor a path"
            data = read_image_source(source)
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except FileNotFoundError:
        return f"names {source!r}, which does not exist"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return f"is not an image PIL can read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


IMAGE_COLUMN = "images"
"""verl's `data.image_key` default: the only image column genrun reads (docs/multimodal.md)."""


def referenced_images_digest(cells: list[Any]) -> bytes:
    """sha256 over the content of every image the cells name by path or URL (in order), so that a
    digest of the rows covers them as it covers bytes held in the file; b"" when none is named."""
    digest = hashlib.sha256()
    named = False
    for images in cells:
        for cell in images or []:
            if isinstance(cell, Mapping):
                if cell.get("bytes") is not None:
                    continue
                cell = cell.get("path") or cell.get("image") or cell.get("image_url")
            if isinstance(cell, str):
                named = True
                digest.update(hashlib.sha256(read_image_source(cell)).digest())
    return digest.digest() if named else b""
