"""Multimodal columns at preflight: images for a vision-language model, nothing else.

verl's RLHFDataset turns a row's images, videos or audio (the columns `data.image_key`,
`data.video_key`, `data.audio_key` name) into the prompt's content with the model's processor
(inputs/tokenizer.run_processor). genrun generates from images with a vision-language model
(docs/multimodal.md); an image column for a text-only model, and any video or audio column, are
refused in one line before anything starts. Preflight looks at the first FIRST_ROWS rows of those
columns alone (a column absent or empty there costs nothing more).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig

from generation_core.errors import GenrunError
from generation_core.inputs.images import image_problem, image_slots, slots_problem
from generation_core.inputs.tokenizer import tokenizer_dir
from generation_core.inputs.vl_processor import model_type

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
    prompt_key = cfg.data.prompt_key
    wanted = [*columns, *([prompt_key] if "image_key" in columns.values() and prompt_key in schema.names else [])]
    if isinstance(source, pq.ParquetFile):
        batch = next(source.iter_batches(batch_size=FIRST_ROWS, columns=wanted), None)
        if batch is None:
            return
        table = pa.Table.from_batches([batch])
    else:
        table = source.select(wanted)
    for column, key in columns.items():
        row = _first_filled(table.column(column).slice(0, FIRST_ROWS))
        if row is None:
            continue
        place = f"data file {url} row {row}: column {column!r} (data.{key}) holds {MEDIA_KEYS[key]}"
        if key != "image_key":
            raise GenrunError(f"{place}, and genrun generates from images only (docs/multimodal.md); drop the column")
        kind, vision = model_type(tokenizer_dir({"path": cfg.actor_rollout_ref.model.path}))
        if not vision:
            raise GenrunError(
                f"{place}, and the model {cfg.actor_rollout_ref.model.path} is a text-only {kind} model: images need "
                "a vision-language model (e.g. Qwen2.5-VL); set actor_rollout_ref.model.path to one, or drop the column"
            )
        if prompt_key in table.column_names:
            check_image_rows(url, column, prompt_key, table.slice(0, FIRST_ROWS))


def check_image_rows(url: str, column: str, prompt_key: str, table: pa.Table) -> None:
    """Refuse the first row whose images a shard could not give the model: an image that does not
    open (corrupt bytes, a path or URL that is not there), or a count of images other than the
    prompt's `<image>` placeholders plus image parts (verl's RLHFDataset pairs them in order)."""
    for row, (images, messages) in enumerate(
        zip(table.column(column).to_pylist(), table.column(prompt_key).to_pylist(), strict=True)
    ):
        images = images or []
        for position, cell in enumerate(images):
            problem = image_problem(cell)
            if problem is not None:
                raise GenrunError(f"data file {url} row {row}: {column}[{position}] {problem}; fix or drop the row")
        slots = image_slots(messages)
        if images and slots != len(images):
            raise GenrunError(f"data file {url} row {row}: its {prompt_key}{slots_problem(slots, len(images), column)}")


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
