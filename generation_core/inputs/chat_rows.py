"""The chat messages of dataset rows, checked before a chat template reads them.

verl hands a row's messages to the chat template as they are, and its overlong filter
(`RLHFDataset.doc2len`) counts a template that raises as a prompt longer than
`data.max_prompt_length`: a row with null content, or no prompt at all, was dropped silently under
that reason. So every row is checked against the messages rule (chat_content.checked_message: a
string role, content of an accepted shape): each shard checks all the rows it reads
(shard_rows.DatasetPrompts), preflight the dataset's first SAMPLE_ROWS rows
(dataset_files.inspect_dataset), and a bad row is refused in one line naming the file, the row,
its `extra_info.index` and what is wrong (`BadInputRow`: a retry would read the same row).
For a vision-language model the rule takes `{"type": "image"}` parts, and each row with images or
image parts must have one placeholder or part per image (`image_counts`); such content lists reach
verl in its `<image>` layout (`placeholder_prompts`).

A prompt column of string roles and string contents can fail the rule only by a null, found with
Arrow compute at no cost worth counting; any other shape (content parts, a number) is read row by
row through the rule itself. Either way the words of a refusal are the rule's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from generation_core.errors import BadInputRow
from generation_core.inputs.chat_content import IMAGE_PLACEHOLDER, BadMessage, checked_message, content_text
from generation_core.inputs.images import IMAGE_COLUMN, image_slots, slots_problem

SAMPLE_ROWS = 256
"""The dataset's first rows preflight checks (each shard checks all of its own)."""


def row_place(url: str, row: int, index: Any) -> str:
    """How a refusal names a dataset row: its file, its 0-based row there and its sample id."""
    return f"data file {url} row {row} (extra_info.index {index})"


def check_chat_rows(
    url: str,
    prompt_key: str,
    prompts: pa.Array | pa.ChunkedArray,
    indices: np.ndarray,
    first_row: int = 0,
    images: np.ndarray | None = None,
) -> None:
    """Refuse the first of `prompts` (the prompt column of consecutive rows of file `url`, from
    its row `first_row`; `indices`: their extra_info.index) that is not a non-empty list of
    messages the rule accepts. `images`: for a vision-language model, each row's image count
    (`image_counts`): `{"type": "image"}` parts are then accepted, and a row with images or image
    parts must have one placeholder or image part per image; None (a text-only model): text only."""
    found = _first_bad_row(prompts, images)
    if found is None:
        return
    row, problem = found
    raise BadInputRow(
        f"{row_place(url, first_row + row, indices[row])}: {prompt_key}{problem}; fix the row or leave it out of the dataset"
    )


def image_counts(images: pa.Array | pa.ChunkedArray | None, rows: int) -> np.ndarray:
    """Per row, how many images the rows' image column holds (0 for all without the column)."""
    if images is None or not (pa.types.is_list(images.type) or pa.types.is_large_list(images.type)):
        return np.zeros(rows, dtype=np.int64)
    return pc.fill_null(pc.list_value_length(images), 0).to_numpy(zero_copy_only=False)


def prompt_problem(prompt: Any, images: int | None = None) -> str | None:
    """What is wrong with one row's prompt (a suffix of the column's name: ` is null`,
    `[0].content is null`), None when a chat template can read it as it is. `images`: the row's
    image count for a vision-language model (None: a text-only model)."""
    if prompt is None:
        return " is null"
    if not isinstance(prompt, list) or not prompt:
        return (
            " holds no messages"
            if isinstance(prompt, list)
            else f" is a {type(prompt).__name__}, not a list of messages"
        )
    image_parts = () if images is None else ("image",)
    for position, message in enumerate(prompt):
        try:
            checked_message(message, image_parts)
        except BadMessage as bad:
            return f"[{position}]{bad}"
    if images is not None:
        slots = image_slots(prompt)
        parts = slots - sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt if isinstance(m["content"], str))
        if (images or parts) and slots != images:
            return slots_problem(slots, images, IMAGE_COLUMN)
    return None


def placeholder_prompts(prompts: list[Any]) -> list[Any]:
    """The prompts with list content in verl's `<image>` layout: each message's content parts
    as the text `content_text` gives with image parts (text parts joined, each image part an
    `<image>`), so verl's RLHFDataset builds the same image parts from the row's images as for
    a row written with placeholders. String content, and prompts of string content, as they are."""
    return [
        prompt
        if not isinstance(prompt, list) or all(isinstance(m.get("content"), str) for m in prompt)
        else [
            dict(m, content=content_text(m["content"], ("image",))) if isinstance(m.get("content"), list) else m
            for m in prompt
        ]
        for prompt in prompts
    ]


def _first_bad_row(prompts: pa.Array | pa.ChunkedArray, images: np.ndarray | None) -> tuple[int, str] | None:
    """(position, problem) of the first bad prompt: the Arrow shortcut skips to the first row
    that may be bad (rows of text messages without images), and the rule decides from there."""
    with_images = images is not None and bool(images.any())
    start = _first_suspect(prompts) if _is_text_messages(prompts.type) and not with_images else 0
    if start is None:
        return None
    for offset in range(start, len(prompts), _WINDOW_ROWS):
        for position, prompt in enumerate(prompts.slice(offset, _WINDOW_ROWS).to_pylist(), start=offset):
            problem = prompt_problem(prompt, None if images is None else int(images[position]))
            if problem is not None:
                return position, problem
    return None


_WINDOW_ROWS = 4096


def _is_text_messages(kind: pa.DataType) -> bool:
    """A list of structs whose role and content are strings: the rule can fail only on a null."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return False
    fields = {field.name: field.type for field in kind.value_type}
    return all(name in fields and pa.types.is_string(fields[name]) for name in ("role", "content"))


def _first_suspect(prompts: pa.Array | pa.ChunkedArray) -> int | None:
    """The first row holding a null or empty prompt, a null message, a null or empty role or a
    null content (None: no such row)."""
    if isinstance(prompts, pa.ChunkedArray):
        prompts = prompts.combine_chunks()
    lengths = pc.list_value_length(prompts)
    empty = pc.fill_null(pc.equal(lengths, 0), True)
    rows = [int(pc.index(empty, True).as_py())] if pc.any(empty).as_py() else []
    messages = pc.list_flatten(prompts)
    roles, contents = pc.struct_field(messages, "role"), pc.struct_field(messages, "content")
    bad = pc.or_(pc.is_null(messages), pc.or_(pc.is_null(contents), pc.fill_null(pc.equal(roles, ""), True)))
    if pc.any(bad).as_py():
        first = int(pc.index(bad, True).as_py())
        rows.append(int(pc.list_parent_indices(prompts)[first].as_py()))
    return min(rows) if rows else None
