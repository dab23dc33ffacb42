"""The input dataset as plain data: which files, how many rows, checked and fingerprinted from
metadata, reading the prompts of the dataset's first rows only (chat_rows.SAMPLE_ROWS: their chat
messages checked; each shard checks its own).

Which files `data.train_files` names, and how they are opened: dataset_location.py.

`inspect_dataset(cfg)` is what preflight runs once per command: Parquet footers (row counts,
schemas), one nested column (`extra_info.index`, checked unique and non-null with Arrow compute)
and `agent_name` when present, plus a sampled content hash for the fingerprint. Its result,
`DatasetFiles` (run_plan.py), is what travels to shard jobs; each shard then reads its own rows
(shard_rows.py).
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from omegaconf import DictConfig

from generation_core.config.loading import train_files
from generation_core.errors import GenrunError, InputChanged
from generation_core.inputs.chat_rows import SAMPLE_ROWS, check_chat_rows, image_counts
from generation_core.inputs.dataset_location import (
    HOW_TO_WRITE,
    data_storage_options,
    input_filesystem,
    resolve_train_files,
    storage_errors,
)
from generation_core.inputs.images import IMAGE_COLUMN
from generation_core.inputs.media_columns import check_text_only
from generation_core.inputs.openai_batch import BatchLimits, FirstSeen, batch_table, is_batch_file
from generation_core.inputs.tokenizer import tokenizer_dir
from generation_core.inputs.vl_processor import model_type
from generation_core.run_plan import DataFile, DatasetFiles
from generation_core.secrets import url_credentials, without_url_credentials

SUPPORTED_SUFFIXES = (".parquet", ".json", ".jsonl")
JSON_MAX_BYTES = 256 << 20
"""JSON/JSONL files are read whole (preflight to count and check them, each shard for its rows):
above this size they are refused with the command that converts them to Parquet."""

# ---- the fingerprint's view of the data (what it reads, what it can miss) -------------------
#
# Hashing every byte costs minutes at millions of prompts (and a full download from S3), and
# mtime/ETag change on every copy or re-upload of the same bytes, which must resume the same run.
# Per file we hash instead: its size, row count, Arrow schema, the Parquet footer bytes (every
# column chunk's offsets, compressed/uncompressed sizes, encodings and min/max statistics) and
# SAMPLE_SLICES slices of SAMPLE_SLICE_BYTES evenly spaced over the file, so a file up to
# 256 KiB is hashed whole. An added, removed or re-ordered row, a re-encoded or re-compressed
# file, a changed schema change the footer; what it can miss is an edit that keeps every size
# and statistic (e.g. one prompt changed in the middle of a large file, same length) and falls
# between the slices. That case is caught per shard: each shard has an exact digest of its own
# rows (shard_rows.DatasetPrompts.rows_digest), recorded in its checkpoint, and a resume over changed
# rows is refused. JSON files (small, see JSON_MAX_BYTES) are hashed whole.
SAMPLE_SLICES = 64
SAMPLE_SLICE_BYTES = 4096


@dataclass
class DatasetInspection:
    """What preflight learns about the dataset, once per command."""

    files: DatasetFiles
    digest: str
    """The dataset's part of the run fingerprint (see SAMPLE_SLICES for what it reads)."""
    agent_names: set[str | None]
    """Distinct per-row `agent_name` values (None: rows without one, or no such column)."""
    row_indices: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    """The sample index (extra_info.index) of every row the run uses, in row order."""


def read_json_table(
    url: str,
    options: dict[str, Any],
    planned: DataFile | None = None,
    batch_limits: BatchLimits | None = None,
    *,
    first_row: int = 0,
    custom_ids: FirstSeen | None = None,
) -> pa.Table:
    """A JSON/JSONL input file, whole (refused above JSON_MAX_BYTES); with `planned`, refused
    when it is not the file the run was planned from (check_planned). An OpenAI batch file
    becomes rows in verl's layout (openai_batch.py), its lines checked against `batch_limits`
    and its custom_ids against `custom_ids` (the run's earlier batch files'), its requests
    numbered from the file's first dataset row (`planned.first_row`, else `first_row`)."""
    fs, path = input_filesystem(url, options)
    size = fs.size(path)
    if size > JSON_MAX_BYTES:
        stem = url.rsplit(".", 1)[0]
        raise GenrunError(
            f"data file {url} is {size / (1 << 20):.0f} MiB of JSON, more than the {JSON_MAX_BYTES >> 20} MiB genrun reads whole; "
            f"convert it to Parquet, e.g. python -c \"import pandas as pd; pd.read_json('{url}', lines=True).to_parquet('{stem}.parquet')\", "
            "and set data.train_files to the Parquet file"
        )
    with fs.open(path, "rb") as handle:
        content = handle.read()
    if is_batch_file(content):
        first = planned.first_row if planned is not None else first_row
        table = batch_table(url, content, batch_limits, first, custom_ids)
    else:
        table = pa_json.read_json(io.BytesIO(content))
    if planned is not None:
        check_planned(planned, size, planned_digest(content), table.num_rows)
    return table


def check_chat_column(url: str, schema: pa.Schema, prompt_key: str) -> None:
    if prompt_key not in schema.names:
        raise GenrunError(
            f"data file {url} has no column {prompt_key!r} (columns: {', '.join(schema.names)}); "
            "set data.prompt_key to the column holding the chat messages"
        )
    kind = schema.field(prompt_key).type
    is_chat = (
        (pa.types.is_list(kind) or pa.types.is_large_list(kind))
        and pa.types.is_struct(kind.value_type)
        and {"role", "content"} <= {f.name for f in kind.value_type}
    )
    if not is_chat:
        raise GenrunError(
            f"data file {url}: column {prompt_key!r} is {kind}, not a list of chat messages; "
            "each prompt must look like [{'role': 'user', 'content': '...'}]"
        )


_INDEX_RULE = "every row needs a unique integer extra_info.index (the sample id used for resume)"


def check_index_field(url: str, schema: pa.Schema) -> None:
    if "extra_info" not in schema.names:
        raise GenrunError(
            f"data file {url} has no extra_info column; every row needs extra_info.index "
            "(a unique integer id per prompt, as verl's preprocessing scripts write it)"
        )
    info = schema.field("extra_info").type
    if not pa.types.is_struct(info) or info.get_field_index("index") < 0:
        raise GenrunError(f"data file {url}: extra_info.index is missing (extra_info is {info}); {_INDEX_RULE}")
    kind = info.field("index").type
    if not pa.types.is_integer(kind):
        raise GenrunError(
            f"data file {url}: extra_info.index is missing or not an integer (it is {kind}); {_INDEX_RULE}"
        )


def _read_indices(url: str, source: pq.ParquetFile | pa.Table, rows: int) -> np.ndarray:
    """The first `rows` extra_info.index values of a file, reading only that nested column."""
    if rows == 0:
        return np.empty(0, dtype=np.int64)
    if isinstance(source, pq.ParquetFile):
        column = source.read(columns=["extra_info.index"]).column("extra_info")
    else:
        column = source.column("extra_info")
    column = column.slice(0, rows)
    indices = pc.struct_field(column, "index")
    # A null extra_info counts as a missing index whatever its child slot holds.
    missing = pc.or_(pc.is_null(indices), pc.is_null(column))
    if pc.any(missing).as_py():
        row = int(pc.index(missing, True).as_py())
        raise GenrunError(f"data file {url} row {row}: extra_info.index is missing or not an integer; {_INDEX_RULE}")
    return indices.to_numpy().astype(np.int64, copy=False)


def check_unique_indices(files: list[DataFile], indices: list[np.ndarray]) -> None:
    """Refuse a repeated extra_info.index, naming the id, where it repeats and where it was first."""
    values = np.concatenate(indices) if indices else np.empty(0, dtype=np.int64)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
    if len(repeated) == 0:
        return
    # The first repeat in dataset order, and the first occurrence of its id.
    position = int(order[repeated + 1].min())
    value = int(values[position])
    first = int(order[np.searchsorted(ordered, value)])
    starts = np.cumsum([0] + [len(i) for i in indices])

    def where(row: int) -> str:
        number = int(np.searchsorted(starts, row, side="right") - 1)
        return f"{files[number].url} row {row - int(starts[number])}"

    raise GenrunError(
        f"data file {where(position)}: extra_info.index {value} repeats (also in {where(first)}); ids must be unique"
    )


def planned_digest(footer_or_content: bytes) -> str:
    """DataFile.digest of a file's Parquet footer (`footer_bytes`) or a JSON file's bytes."""
    return hashlib.sha256(footer_or_content).hexdigest()


def check_planned(data_file: DataFile, size: int, digest: str | None = None, rows: int | None = None) -> None:
    """Refuse a file that is not the one the run was planned from: shards of a long run start
    hours after preflight, and a file replaced or cut meanwhile would give a shard other rows
    (or fewer) than its range, which it would commit as if they were the planned ones. `digest`
    and `rows` None: not checked (yet)."""
    changes = []
    if data_file.size is not None and size != data_file.size:
        changes.append(f"{size} bytes, planned {data_file.size}")
    if rows is not None and rows != data_file.rows:
        changes.append(f"{rows} rows, planned {data_file.rows}")
    if digest is not None and data_file.digest is not None and digest != data_file.digest and not changes:
        changes.append("its Parquet footer differs" if data_file.is_parquet else "its content differs")
    if changes:
        raise InputChanged(
            f"data file {data_file.url} changed since the run was planned ({'; '.join(changes)}); restore the file as it was and "
            "run the same command again to resume, or run the command again on the new file to plan a new run "
            "(a changed dataset has another fingerprint, so its output goes to another folder)"
        )


def footer_bytes(handle, size: int) -> bytes:
    """A Parquet file's footer (its metadata), read from an open binary `handle` of `size` bytes."""
    handle.seek(size - 8)
    footer_len = int.from_bytes(handle.read(8)[:4], "little")
    handle.seek(max(size - 8 - footer_len, 0))
    return handle.read(footer_len)


def _sampled_content(fs, path: str, size: int) -> bytes:
    if size <= SAMPLE_SLICES * SAMPLE_SLICE_BYTES:
        return fs.cat_file(path)
    starts = [size * k // SAMPLE_SLICES for k in range(SAMPLE_SLICES)]
    # One range request per slice, concurrent on object stores.
    return b"".join(fs.cat_ranges([path] * SAMPLE_SLICES, starts, [min(s + SAMPLE_SLICE_BYTES, size) for s in starts]))


def _refuse_urls_with_credentials(urls: list[str]) -> None:
    """An input file's URL is stored (run.json, the plan Prefect keeps, the report): one that carries
    credentials (`https://user:password@host/...`, a signed URL) is refused rather than stored."""
    for url in urls:
        if url_credentials(str(url)):
            raise GenrunError(
                f"data.train_files holds a URL with credentials ({without_url_credentials(str(url))}): genrun stores its input "
                "files' URLs; give the credentials through data.storage_options (e.g. profile=NAME) or the environment"
            )


def inspect_dataset(cfg: DictConfig) -> DatasetInspection:
    """Resolve, check and fingerprint the input files from metadata plus one nested column
    (extra_info.index) and agent_name; see SAMPLE_SLICES for the fingerprint's trade-off."""
    _refuse_urls_with_credentials(train_files(cfg))
    options = data_storage_options(cfg)
    cap = cfg.data.train_max_samples if cfg.data.train_max_samples and cfg.data.train_max_samples > 0 else None
    files: list[DataFile] = []
    indices: list[np.ndarray] = []
    agent_names: set[str | None] = set()
    digest = hashlib.sha256()
    reference: tuple[str, pa.Schema] | None = None
    custom_ids: FirstSeen = {}
    used = 0
    for url in resolve_train_files(cfg):
        first_row = sum(f.rows for f in files)
        if not url.endswith(SUPPORTED_SUFFIXES):
            raise GenrunError(
                f"data file {url}: unsupported format; use {', '.join(SUPPORTED_SUFFIXES)} ({HOW_TO_WRITE})"
            )
        with storage_errors(url):
            fs, path = input_filesystem(url, options)
            size = fs.size(path)
            if url.endswith(".parquet"):
                with fs.open(path, "rb") as handle:
                    parquet = pq.ParquetFile(handle)
                    schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
                    take = rows if cap is None else max(min(rows, cap - used), 0)
                    names = _check_file(cfg, url, parquet, schema, reference, take, used, indices)
                    footer = footer_bytes(handle, size)
                    content = footer + _sampled_content(fs, path, size)
                    file_digest = planned_digest(footer)
            else:
                # Several OpenAI batch files: custom_ids unique across them, requests numbered on.
                table = read_json_table(
                    url, options, batch_limits=BatchLimits.of(cfg), first_row=first_row, custom_ids=custom_ids
                )
                schema, rows = table.schema, table.num_rows
                take = rows if cap is None else max(min(rows, cap - used), 0)
                names = _check_file(cfg, url, table, schema, reference, take, used, indices)
                content = fs.cat_file(path)
                file_digest = planned_digest(content)
        agent_names |= names
        reference = reference or (url, schema)
        files.append(DataFile(url, rows, size, file_digest, first_row))
        used += take
        digest.update(json.dumps({"size": size, "rows": rows, "schema": schema.remove_metadata().to_string()}).encode())
        digest.update(hashlib.sha256(content).digest())
    if used == 0:
        raise GenrunError(f"the dataset is empty ({', '.join(f.url for f in files)} hold no rows)")
    check_unique_indices(files, indices)
    return DatasetInspection(DatasetFiles(tuple(files), used), digest.hexdigest(), agent_names, np.concatenate(indices))


def _check_file(
    cfg: DictConfig,
    url: str,
    source: pq.ParquetFile | pa.Table,
    schema: pa.Schema,
    reference: tuple[str, pa.Schema] | None,
    take: int,
    used: int,
    indices: list[np.ndarray],
) -> set[str | None]:
    """The checks of one file (`source`: the open Parquet file, or a JSON file's table) whose first
    `take` rows the run uses after `used` rows of earlier files: its schema, media columns, ids
    (appended to `indices`) and the chat messages of the rows in the dataset's first SAMPLE_ROWS.
    Returns its agent names."""
    _check_schema(url, schema, cfg.data.prompt_key, reference)
    check_text_only(cfg, url, schema, source)
    indices.append(_read_indices(url, source, take))
    _check_sample(cfg, url, source, schema, indices[-1], max(min(take, SAMPLE_ROWS - used), 0))
    if not take or "agent_name" not in schema.names:
        return _agent_names(None, take)
    return _agent_names(source.read(columns=["agent_name"]) if isinstance(source, pq.ParquetFile) else source, take)


def _check_sample(
    cfg: DictConfig, url: str, source: pq.ParquetFile | pa.Table, schema: pa.Schema, indices: np.ndarray, rows: int
) -> None:
    """Check the chat messages of a file's first `rows` rows (those of the dataset's first
    SAMPLE_ROWS that it holds), reading only the prompt column of those rows (and their image
    column, for a vision-language model: `_may_hold_images`)."""
    if rows == 0:
        return
    prompt_key = cfg.data.prompt_key
    images = _may_hold_images(cfg, schema)
    columns = [prompt_key, *([IMAGE_COLUMN] if images and IMAGE_COLUMN in schema.names else [])]
    if isinstance(source, pq.ParquetFile):
        table = pa.Table.from_batches([next(source.iter_batches(batch_size=rows, columns=columns))])
    else:
        table = source.select(columns)
    table = table.slice(0, rows)
    counts = None
    if images:
        counts = image_counts(table.column(IMAGE_COLUMN) if IMAGE_COLUMN in columns else None, table.num_rows)
    check_chat_rows(url, prompt_key, table.column(prompt_key), indices, images=counts)


def _may_hold_images(cfg: DictConfig, schema: pa.Schema) -> bool:
    """Whether the rows may give images (an image column, or content lists that may hold image
    parts) to a vision-language model: the model's config is read only then."""
    kind = schema.field(cfg.data.prompt_key).type
    value = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    content = (
        value.field("content").type
        if value is not None and pa.types.is_struct(value) and value.get_field_index("content") >= 0
        else None
    )
    if IMAGE_COLUMN not in schema.names and (content is None or pa.types.is_string(content)):
        return False
    return model_type(tokenizer_dir({"path": cfg.actor_rollout_ref.model.path}))[1]


def _agent_names(table: pa.Table | None, rows: int) -> set[str | None]:
    """Distinct agent_name values of a file's first `rows` rows (None for rows without one)."""
    if rows == 0:
        return set()
    if table is None:
        return {None}
    return set(pc.unique(table.column("agent_name").slice(0, rows)).to_pylist())


def _check_schema(url: str, schema: pa.Schema, prompt_key: str, reference: tuple[str, pa.Schema] | None) -> None:
    check_chat_column(url, schema, prompt_key)
    check_index_field(url, schema)
    if reference is None or schema.remove_metadata().equals(reference[1].remove_metadata()):
        return
    first_url, first = reference
    differing = (
        sorted(set(schema.names) ^ set(first.names))
        or [name for name in first.names if not schema.field(name).type.equals(first.field(name).type)]
        or list(first.names)
    )
    name = differing[0]
    here = str(schema.field(name).type) if name in schema.names else "absent"
    there = str(first.field(name).type) if name in first.names else "absent"
    raise GenrunError(
        f"data file {url} has another schema than {first_url} (column {name!r}: {here} here, {there} there); "
        "every file of data.train_files must have the same columns and types: rewrite them with one schema"
    )
