"""A shard's own rows and prompts.

Shards are ranges of raw dataset rows, planned from row counts alone (run_plan.plan_shards); each
shard job reads only its rows (`DatasetPrompts`: the row groups overlapping its range, through
fsspec), checks their chat messages (inputs/chat_rows.py), applies verl's overlong filter to
them and hands verl's agent loops the same keyword arguments verl's `RLHFDataset` would give for
those rows. A row whose chat template raises is refused by name (`BadInputRow`): verl's filter
would count it as longer than data.max_prompt_length.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig

from generation_core.errors import BadInputRow, GenrunError
from generation_core.inputs.chat_rows import check_chat_rows, image_counts, placeholder_prompts, row_place
from generation_core.inputs.dataset_files import (
    check_planned,
    footer_bytes,
    planned_digest,
    read_json_table,
)
from generation_core.inputs.dataset_location import data_storage_options, open_input, storage_errors
from generation_core.inputs.images import IMAGE_COLUMN, referenced_images_digest, vision_info
from generation_core.inputs.tokenizer import run_processor
from generation_core.run_plan import DataFile, DatasetFiles, ShardSpec
from generation_core.verl_adapter import (
    PromptLengthSettings,
    hand_rows,
    overlong_prompt_rule,
    prompt_length_settings,
    rows_dataset,
)

logger = logging.getLogger(__name__)

OVERLONG_SAMPLE_ROWS = 256
"""Prompts preflight tokenizes to refuse a run whose prompts are all too long (the exact filter
runs per shard, on the shard's rows)."""

READ_BATCH_ROWS = 8192
DECIDE_WINDOW_ROWS = 64
"""Rows whose prompt length a shard decides in one tokenizer call (just ahead of dispatch)."""
DIGEST_WINDOW_ROWS = 8192


def read_rows(dataset: DatasetFiles, start: int, end: int, storage_options: dict[str, Any]) -> pa.Table:
    """Dataset rows [start, end) as one Arrow table: from each overlapping Parquet file only the
    row groups that intersect the range (streamed in batches, so a large row group is decoded
    up to the range's end and kept only where it overlaps); JSON files are read whole. Each file
    must still be the one the run was planned from (size, footer or content digest, row count:
    `check_planned`), and the rows read must be the range's: a file replaced or cut since
    preflight is refused here, before the shard generates anything."""
    tables = []
    for data_file, lo, hi in dataset.pieces(start, end):
        with storage_errors(data_file.url):
            if data_file.is_parquet:
                tables.append(_read_parquet_rows(data_file, lo, hi, storage_options))
            else:
                tables.append(read_json_table(data_file.url, storage_options, planned=data_file).slice(lo, hi - lo))
    if not tables:
        raise GenrunError(f"dataset rows [{start}, {end}) lie outside the dataset's {dataset.num_rows} rows")
    planned, read = min(end, dataset.num_rows) - start, sum(t.num_rows for t in tables)
    if read != planned:
        raise GenrunError(
            f"dataset rows [{start}, {end}): {read} read, {planned} planned; the input files changed since the run was planned: "
            "restore them and run the same command again, or run the command again to plan the changed dataset as a new run"
        )
    metadata = tables[0].schema.metadata
    return pa.concat_tables([t.replace_schema_metadata(metadata) for t in tables])


def _read_parquet_rows(data_file: DataFile, lo: int, hi: int, storage_options: dict[str, Any]) -> pa.Table:
    with open_input(data_file.url, storage_options) as handle:
        size = handle.seek(0, os.SEEK_END)
        # The size first: the footer of a cut file is not there to read.
        check_planned(data_file, size)
        footer = footer_bytes(handle, size)
        parquet = pq.ParquetFile(handle)
        check_planned(data_file, size, planned_digest(footer), parquet.metadata.num_rows)
        groups, first_row, offset = [], None, 0
        for group in range(parquet.metadata.num_row_groups):
            rows = parquet.metadata.row_group(group).num_rows
            if offset < hi and offset + rows > lo:
                groups.append(group)
                first_row = offset if first_row is None else first_row
            offset += rows
        batches, position = [], first_row or 0  # None: no row group overlaps, nothing is read
        for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=groups, use_threads=False):
            keep_from, keep_to = max(lo - position, 0), min(hi - position, batch.num_rows)
            if keep_to > keep_from:
                batches.append(batch.slice(keep_from, keep_to - keep_from))
            position += batch.num_rows
            if position >= hi:
                break
        return pa.Table.from_batches(batches, schema=parquet.schema_arrow)


def rows_digest(table: pa.Table) -> str:
    """sha256 of the rows' Arrow IPC serialization, in fixed windows of rows. The same file read
    the same way gives the same digest. It is stricter than the rows alone: a slice of a nested
    column (the chat messages) serializes buffers it shares with its row group's other rows, so an
    edit to a row of the same row group outside the shard changes the digest too (seen in
    tests/test_dataset_input.py): such a shard is refused as changed, never reused wrongly.
    Making it exact would change every recorded digest; that needs a digest version."""
    digest = hashlib.sha256(table.schema.remove_metadata().serialize().to_pybytes())
    table = table.replace_schema_metadata(None)
    for offset in range(0, table.num_rows, DIGEST_WINDOW_ROWS):
        window = table.slice(offset, DIGEST_WINDOW_ROWS).combine_chunks()
        for batch in window.to_batches():
            digest.update(batch.serialize().to_pybytes())
    if IMAGE_COLUMN in table.column_names:
        # Images named by path or URL: their content, so a changed image is a changed row.
        digest.update(referenced_images_digest(table.column(IMAGE_COLUMN).to_pylist()))
    return digest.hexdigest()


class _BatchedLengths:
    """Prompt token counts of many rows in one tokenizer call: what verl's text-only `doc2len`
    computes per row (the chat template with the generation prompt and the dataset's tool schemas
    and template kwargs, then the tokenizer without special tokens), ~6x cheaper per row because
    the template renders and the tokenizer encodes a whole window at once. Only for datasets
    without a processor (verl's multimodal rule stays per row), and only while it agrees with
    verl's own predicate (DatasetPrompts checks the first window of every shard against it)."""

    def __init__(self, settings: PromptLengthSettings, tokenizer):
        self.prompt_key = settings.prompt_key
        self.max_prompt_length = settings.max_prompt_length
        self.tokenizer = tokenizer
        self.template_kwargs = settings.template_kwargs

    def keeps(self, docs: list[dict]) -> list[bool] | None:
        """Per doc, whether it fits data.max_prompt_length; None when the batch call fails (the
        caller then asks verl's predicate row by row, which reports the row that fails)."""
        try:
            texts = self.tokenizer.apply_chat_template(
                [doc[self.prompt_key] for doc in docs],
                add_generation_prompt=True,
                tokenize=False,
                **self.template_kwargs,
            )
            ids = self.tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]
        except Exception:  # noqa: BLE001 - any failure goes to verl's per-row rule, which reports it
            return None
        return [len(row) <= self.max_prompt_length for row in ids]


class DatasetPrompts:
    """The prompts of dataset rows [start, end), as the keyword arguments verl's agent loops take.

    The rows are held as Arrow (a `datasets.Dataset` over the shard's table) and become Python
    one row at a time, when an agent loop needs them. verl's overlong filter
    (`RLHFDataset.maybe_filter_out_long_prompts`'s rule) is decided per row when the row is first
    asked about (`keeps`): the shard job asks just before it dispatches the row, so the shard's
    first request never waits for its whole range to be tokenized.

    Two views: raw rows (`num_rows`, `row_index`, `keeps`, `row_kwargs`: what the shard job
    streams over, shard/protocols.py's ShardPrompts) and kept rows (`len`, `sample_index`,
    `agent_kwargs`: decides every row at once; library use and tests)."""

    def __init__(self, cfg: DictConfig, dataset: DatasetFiles, start: int, end: int, tokenizer):
        # Here, not at the top: planning shards and digesting rows (a finished run's rerun, the
        # flow's check) import this module without the datasets and torch stacks.
        import datasets
        import torch

        self._tensor_type = torch.Tensor
        table = read_rows(dataset, start, end, data_storage_options(cfg))
        self._indices = pc.struct_field(table.column("extra_info"), "index").to_numpy()
        prompt_key = cfg.data.prompt_key
        processor = run_processor(cfg.actor_rollout_ref.model)
        images = None
        if processor is not None:
            column = table.column(IMAGE_COLUMN) if IMAGE_COLUMN in table.column_names else None
            images = image_counts(column, table.num_rows)
        self._pieces = _check_messages(dataset, start, end, prompt_key, table.column(prompt_key), self._indices, images)
        self.tokenizer = tokenizer
        self.rows_digest = rows_digest(table)
        """sha256 of the shard's raw rows (before filtering): a resume over changed rows is refused with it."""
        if processor is not None:
            # Image parts in content lists (verl reads only `<image>` in string content): as the
            # `<image>` layout, so verl's RLHFDataset builds the same messages from the row's images.
            table = _placeholder_layout(table, prompt_key)
        # verl's RLHFDataset over the shard's rows: its overlong filter and __getitem__ stay verl's.
        # A VL model's processor builds image parts from the row's images (inputs/images.py reads them).
        self._dataset = rows_dataset(cfg.data, tokenizer, processor, None if processor is None else vision_info)
        self._rows = datasets.Dataset(datasets.table.InMemoryTable(table))
        hand_rows(self._dataset, self._rows)
        self._length_rule = overlong_prompt_rule(self._dataset)
        length_settings = self._length_settings = prompt_length_settings(self._dataset)
        self._batched_lengths = (
            _BatchedLengths(length_settings, tokenizer)
            if self._length_rule is not None and not length_settings.has_processor
            else None
        )
        self._batched_checked = False
        self.num_rows = table.num_rows
        # Per raw row: 1 kept, 0 dropped as overlong, -1 not decided yet.
        self._decided = np.full(self.num_rows, -1 if self._length_rule is not None else 1, dtype=np.int8)
        self._kept_positions: np.ndarray | None = None
        self.default_agent_loop = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        self._names = (
            pc.unique(table.column("agent_name")).to_pylist() if "agent_name" in table.column_names else [None]
        )
        self.dispatch_rows: Sequence[int] = range(self.num_rows)
        """The raw rows in the order the shard job dispatches them: dataset order."""

    @classmethod
    def for_shard(cls, cfg: DictConfig, dataset: DatasetFiles, shard: ShardSpec, tokenizer) -> DatasetPrompts:
        """The shard's prompts."""
        return cls(cfg, dataset, shard.start, shard.end, tokenizer)

    # ---- raw rows, decided lazily (the shard job) ----

    def row_index(self, row: int) -> int:
        """Raw row `row`'s `extra_info.index` (its sample id), without building the row."""
        return int(self._indices[row])

    def keeps(self, row: int) -> bool:
        """Whether verl's overlong filter keeps raw row `row`. The first time, decides the rows
        from `row` to the next DECIDE_WINDOW_ROWS at once (the shard asks in row order)."""
        if self._decided[row] < 0:
            self._decide(row, min(row + DECIDE_WINDOW_ROWS, self.num_rows))
        return bool(self._decided[row])

    def _decide(self, lo: int, hi: int) -> None:
        rows = [r for r in range(lo, hi) if self._decided[r] < 0]
        length_rule = self._length_rule
        assert length_rule is not None, "a row is undecided only while verl's overlong filter is on"
        docs = self._rows.select(rows).to_list() if len(rows) > 1 else [self._rows[rows[0]]]
        decided = self._batched_lengths.keeps(docs) if self._batched_lengths is not None else None
        if decided is None:
            # No batched count (its call failed, or it is off): verl's rule decides each row, and
            # its doc2len counts a template that raises as too long. Such a row is refused by
            # name first (a batched call that succeeded rendered every row already).
            self._refuse_template_errors(rows, docs)
        if decided is not None and not self._batched_checked:
            # The batched count must be verl's: checked against its own predicate on this window.
            verls = [bool(length_rule(doc)) for doc in docs]
            if verls != decided:
                logger.warning(
                    "the batched prompt-length check disagrees with verl's overlong filter on this dataset; filtering row by row with verl's"
                )
                self._batched_lengths = None
            decided = verls
            self._batched_checked = True
        if decided is None:
            decided = [bool(length_rule(doc)) for doc in docs]
        self._decided[rows] = decided

    def _refuse_template_errors(self, rows: list[int], docs: list[dict]) -> None:
        """Refuse the first of these rows whose chat template raises (called as verl's doc2len
        calls it, less the tokenizing), naming the row and the template's error."""
        settings = self._length_settings
        if settings.has_processor:
            return  # verl measures these with the processor, over messages it builds: not checked here
        for row, doc in zip(rows, docs, strict=True):
            try:
                self.tokenizer.apply_chat_template(
                    doc[settings.prompt_key], add_generation_prompt=True, tokenize=False, **settings.template_kwargs
                )
            except Exception as exc:  # noqa: BLE001 - a template (the model's, user code) may raise anything
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                raise BadInputRow(
                    f"{self._place(row)}: the chat template cannot render its {settings.prompt_key} ({reason}); "
                    "fix the row or leave it out of the dataset (verl would drop it as longer than data.max_prompt_length)"
                ) from None

    def _place(self, row: int) -> str:
        """Raw row `row` as a refusal names it (chat_rows.row_place)."""
        for url, first_row, offset, count in self._pieces:
            if row < offset + count:
                return row_place(url, first_row + row - offset, self.row_index(row))
        raise IndexError(row)

    def row_kwargs(self, row: int) -> dict[str, Any]:
        """Raw row `row`'s non-tensor fields, as verl's generate_sequences passes them to an agent loop."""
        item = self._dataset[row]
        kwargs = {k: v for k, v in item.items() if not isinstance(v, self._tensor_type)}
        # A null agent_name (a file where only some rows name one) means the default, as in
        # agent_names(); verl's registry has no loop named None.
        if kwargs.get("agent_name") is None:
            kwargs["agent_name"] = self.default_agent_loop
        return kwargs

    @property
    def filtered_overlong(self) -> int:
        """Rows decided so far to be longer than data.max_prompt_length: never generated."""
        return int((self._decided == 0).sum())

    def agent_names(self) -> set[str]:
        """Every agent loop the shard's rows ask for (per-row `agent_name`, else the default)."""
        return {name or self.default_agent_loop for name in self._names}

    # ---- kept rows, all decided at once (library use, tests) ----

    def _kept(self) -> np.ndarray:
        if self._kept_positions is None:
            self._kept_positions = np.array([row for row in range(self.num_rows) if self.keeps(row)], dtype=np.int64)
        return self._kept_positions

    def __len__(self) -> int:
        return len(self._kept())

    def sample_index(self, position: int) -> int:
        """The `position`-th kept row's sample id."""
        return self.row_index(int(self._kept()[position]))

    def agent_kwargs(self, position: int) -> dict[str, Any]:
        """The `position`-th kept row's agent-loop keyword arguments."""
        return self.row_kwargs(int(self._kept()[position]))


def _check_messages(
    dataset: DatasetFiles,
    start: int,
    end: int,
    prompt_key: str,
    prompts: pa.ChunkedArray,
    indices: np.ndarray,
    images: np.ndarray | None,
) -> list[tuple[str, int, int, int]]:
    """Check every row's chat messages (chat_rows.check_chat_rows; `images`: each row's image
    count for a vision-language model), file by file; returns the pieces read, (url, first file
    row, first table row, rows), to name a row later."""
    pieces, offset = [], 0
    for data_file, lo, hi in dataset.pieces(start, end):
        rows = hi - lo
        check_chat_rows(
            data_file.url,
            prompt_key,
            prompts.slice(offset, rows),
            indices[offset : offset + rows],
            lo,
            None if images is None else images[offset : offset + rows],
        )
        pieces.append((data_file.url, lo, offset, rows))
        offset += rows
    return pieces


def _placeholder_layout(table: pa.Table, prompt_key: str) -> pa.Table:
    """The table with its prompt column in verl's `<image>` layout (chat_rows.placeholder_prompts)
    when its messages' content is a list of parts; as it is otherwise."""
    kind = table.schema.field(prompt_key).type
    value = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    if value is None or not pa.types.is_struct(value) or value.get_field_index("content") < 0:
        return table
    if pa.types.is_string(value.field("content").type):
        return table
    prompts = placeholder_prompts(table.column(prompt_key).to_pylist())
    return table.set_column(table.schema.get_field_index(prompt_key), prompt_key, pa.array(prompts))


def check_overlong_sample(cfg: DictConfig, dataset: DatasetFiles, tokenizer) -> None:
    """Refuse a run whose prompts are all too long, from the first OVERLONG_SAMPLE_ROWS rows
    (preflight does not tokenize the dataset; each shard filters its own rows exactly)."""
    if not cfg.data.filter_overlong_prompts:
        return
    sample = DatasetPrompts(cfg, dataset, 0, min(OVERLONG_SAMPLE_ROWS, dataset.num_rows), tokenizer)
    if len(sample) == 0:
        raise GenrunError(
            f"no prompt left after filtering: all {sample.filtered_overlong} sampled prompts (the dataset's first rows) are longer "
            f"than data.max_prompt_length={cfg.data.max_prompt_length} tokens; raise it or turn off data.filter_overlong_prompts"
        )


def planned_rows(files: DatasetFiles, options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The rows a run was planned over (run.json's dataset), file by file, as dicts: each file
    checked to be the one planned (check_planned) and an OpenAI batch file's requests numbered
    from its first dataset row, as the run's shards read them."""
    for data_file, lo, hi in files.pieces(0, files.num_rows):
        with storage_errors(data_file.url):
            if data_file.is_parquet:
                with open_input(data_file.url, options) as handle:
                    table: pa.Table = pq.read_table(handle)
            else:
                table = read_json_table(data_file.url, options, planned=data_file)
        yield from table.slice(lo, hi - lo).to_pylist()
