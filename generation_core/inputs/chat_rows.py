"""The chat messages of dataset rows, checked before a chat template reads them.

verl hands a row's messages to the chat template as they are, and its overlong filter
(`RLHFDataset.doc2len`) counts a template that raises as a prompt longer than
`data.max_prompt_length`: a row with null content, or no prompt at all, was dropped silently under
that reason. So every row is checked against the messages rule (chat_content.checked_message: a
string role, content of an accepted shape): each shard checks all the rows it reads
(shard_rows.DatasetPrompts), preflight the dataset's first SAMPLE_ROWS rows
(dataset_files.inspect_dataset), and a bad row is refused in one line naming the file, the row,
its `extra_info.index` and what is wrong (`BadInputRow`: a retry would read the same row).

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
from generation_core.inputs.chat_content import BadMessage, checked_message

SAMPLE_ROWS = 256
"""The dataset's first rows preflight checks (each shard checks all of its own)."""


def row_place(url: str, row: int, index: Any) -> str:
    """How a refusal names a dataset row: its file, its 0-based row there and its sample id."""
    return f"data file {url} row {row} (extra_info.index {index})"


def check_chat_rows(
    url: str, prompt_key: str, prompts: pa.Array | pa.ChunkedArray, indices: np.ndarray, first_row: int = 0
) -> None:
    """Refuse the first of `prompts` (the prompt column of consecutive rows of file `url`, from
    its row `first_row`; `indices`: their extra_info.index) that is not a non-empty list of
    messages the rule accepts."""
    found = _first_bad_row(prompts)
    if found is None:
        return
    row, problem = found
    raise BadInputRow(
        f"{row_place(url, first_row + row, indices[row])}: {prompt_key}{problem}; fix the row or leave it out of the dataset"
    )


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with one row's prompt (a suffix of the column's name: ` is null`,
    `[0].content is null`), None when a chat template can read it as it is."""
    if prompt is None:
        return " is null"
    if not isinstance(prompt, list) or not prompt:
        return (
            " holds no messages"
            if isinstance(prompt, list)
            else f" is a {type(prompt).__name__}, not a list of messages"
        )
    for position, message in enumerate(prompt):
        try:
            checked_message(message)
        except BadMessage as bad:
            return f"[{position}]{bad}"
    return None


def _first_bad_row(prompts: pa.Array | pa.ChunkedArray) -> tuple[int, str] | None:
    """(position, problem) of the first bad prompt: the Arrow shortcut skips to the first row
    that may be bad, and the rule decides from there."""
    start = _first_suspect(prompts) if _is_text_messages(prompts.type) else 0
    if start is None:
        return None
    for offset in range(start, len(prompts), _WINDOW_ROWS):
        for position, prompt in enumerate(prompts.slice(offset, _WINDOW_ROWS).to_pylist(), start=offset):
            problem = prompt_problem(prompt)
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
