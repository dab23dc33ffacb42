"""Refuse multimodal prompts at preflight, until genrun supports them.

verl's RLHFDataset turns a row's images, videos or audio (the columns `data.image_key`,
`data.video_key`, `data.audio_key` name) into the prompt's content only with the model's
processor, which genrun's shards do not load: such a row failed inside its shard, after every
retry, with `AssertionError: processor is needed`. Preflight looks at the first FIRST_ROWS rows
of those columns alone (a column absent or empty there costs nothing more), so a multimodal
dataset is refused in one line before anything starts.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig

from generation_core.errors import GenrunError

MEDIA_KEYS = {"image_key": "images", "video_key": "videos", "audio_key": "audios"}
"""data.* key -> what its column holds (verl's default column has the same name)."""

FIRST_ROWS = 64
"""Rows of each file whose media columns preflight reads."""


def check_text_only(cfg: DictConfig, url: str, schema: pa.Schema, source: pq.ParquetFile | pa.Table) -> None:
    """Refuse a file whose media columns hold something in its first FIRST_ROWS rows, reading
    only those columns of those rows (`source`: the open Parquet file, or a JSON file's table)."""
    columns = {
        column: key for key in MEDIA_KEYS if isinstance(column := cfg.data.get(key), str) and column in schema.names
    }
    if not columns:
        return
    if isinstance(source, pq.ParquetFile):
        batch = next(source.iter_batches(batch_size=FIRST_ROWS, columns=list(columns)), None)
        if batch is None:
            return
        table = pa.Table.from_batches([batch])
    else:
        table = source.select(list(columns))
    for column, key in columns.items():
        row = _first_filled(table.column(column).slice(0, FIRST_ROWS))
        if row is not None:
            raise GenrunError(
                f"data file {url} row {row}: column {column!r} (data.{key}) holds {MEDIA_KEYS[key]}, and genrun "
                "does not generate from multimodal prompts yet (its shards build prompts without the model's "
                "processor); use text-only prompts, or drop the column"
            )


def _first_filled(values: pa.ChunkedArray) -> int | None:
    """The first row holding a value: not null, and not an empty list or string."""
    kind = values.type
    if pa.types.is_null(kind):
        return None
    filled = pc.is_valid(values)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        filled = pc.and_(filled, pc.greater(pc.fill_null(pc.list_value_length(values), 0), 0))
    elif (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
    ):
        filled = pc.and_(filled, pc.greater(pc.fill_null(pc.binary_length(values), 0), 0))
    if not pc.any(filled).as_py():
        return None
    return int(pc.index(filled, True).as_py())
