"""Shards as ranges of raw dataset rows, and a shard's own prompts.

The driver plans from row counts alone (`plan_shards`, over `dataset_files.DatasetFiles`); each
shard job reads only its rows (`ShardPrompts`: the row groups overlapping its range, through
fsspec), applies verl's overlong filter to them and hands verl's agent loops the same keyword
arguments verl's `RLHFDataset` would give for those rows.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig

from generation_core.dataset_files import (
    DatasetFiles,
    data_storage_options,
    open_input,
    read_json_table,
    storage_errors,
)
from generation_core.errors import GenrunError
from generation_core.run_folder import shard_name

logger = logging.getLogger(__name__)

OVERLONG_SAMPLE_ROWS = 256
"""Prompts preflight tokenizes to refuse a run whose prompts are all too long (the exact filter
runs per shard, on the shard's rows)."""

READ_BATCH_ROWS = 8192
DIGEST_WINDOW_ROWS = 8192


@dataclass(frozen=True)
class ShardSpec:
    """A fixed range of raw dataset rows [start, end) and its stable name."""

    shard_id: int
    start: int
    end: int

    @property
    def name(self) -> str:
        return shard_name(self.shard_id)

    def __len__(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, payload: dict[str, int]) -> ShardSpec:
        return cls(int(payload["shard_id"]), int(payload["start"]), int(payload["end"]))


def plan_shards(num_rows: int, num_shards: int) -> list[ShardSpec]:
    """Split rows 0..num_rows into `num_shards` contiguous, nearly equal ranges."""
    if num_shards > num_rows:
        raise GenrunError(f"generation.num_shards={num_shards} is more than the {num_rows} prompts; use at most {num_rows}")
    base, extra = divmod(num_rows, num_shards)
    shards, start = [], 0
    for shard_id in range(num_shards):
        end = start + base + (1 if shard_id < extra else 0)
        shards.append(ShardSpec(shard_id, start, end))
        start = end
    return shards


def read_rows(dataset: DatasetFiles, start: int, end: int, storage_options: dict[str, Any]) -> pa.Table:
    """Dataset rows [start, end) as one Arrow table: from each overlapping Parquet file only the
    row groups that intersect the range (streamed in batches, so a large row group is decoded
    up to the range's end and kept only where it overlaps); JSON files are read whole."""
    tables = []
    for data_file, lo, hi in dataset.pieces(start, end):
        with storage_errors(data_file.url):
            if data_file.is_parquet:
                tables.append(_read_parquet_rows(data_file.url, lo, hi, storage_options))
            else:
                tables.append(read_json_table(data_file.url, storage_options).slice(lo, hi - lo))
    if not tables:
        raise GenrunError(f"dataset rows [{start}, {end}) lie outside the dataset's {dataset.num_rows} rows")
    metadata = tables[0].schema.metadata
    return pa.concat_tables([t.replace_schema_metadata(metadata) for t in tables])


def _read_parquet_rows(url: str, lo: int, hi: int, storage_options: dict[str, Any]) -> pa.Table:
    with open_input(url, storage_options) as handle:
        parquet = pq.ParquetFile(handle)
        groups, first_row, offset = [], None, 0
        for group in range(parquet.metadata.num_row_groups):
            rows = parquet.metadata.row_group(group).num_rows
            if offset < hi and offset + rows > lo:
                groups.append(group)
                first_row = offset if first_row is None else first_row
            offset += rows
        batches, position = [], first_row
        for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=groups, use_threads=False):
            keep_from, keep_to = max(lo - position, 0), min(hi - position, batch.num_rows)
            if keep_to > keep_from:
                batches.append(batch.slice(keep_from, keep_to - keep_from))
            position += batch.num_rows
            if position >= hi:
                break
        return pa.Table.from_batches(batches, schema=parquet.schema_arrow)


def rows_digest(table: pa.Table) -> str:
    """sha256 of the rows' Arrow IPC serialization, in fixed windows of rows (the same rows give
    the same digest whatever row groups or files they were read from)."""
    digest = hashlib.sha256(table.schema.remove_metadata().serialize().to_pybytes())
    table = table.replace_schema_metadata(None)
    for offset in range(0, table.num_rows, DIGEST_WINDOW_ROWS):
        window = table.slice(offset, DIGEST_WINDOW_ROWS).combine_chunks()
        for batch in window.to_batches():
            digest.update(batch.serialize().to_pybytes())
    return digest.hexdigest()


def _rlhf_dataset(cfg: DictConfig, tokenizer):
    """verl's RLHFDataset with its own settings (tool schemas, chat-template kwargs, filter
    switches, all as its __init__ reads them from data.*) but without loading files: the shard
    hands it its rows. Its file hooks (_download, _read_files_and_tokenize) are the ones verl's
    custom dataset classes override, so its filter and __getitem__ stay verl's own."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    class RowsDataset(RLHFDataset):
        def _download(self, use_origin_parquet=False):
            pass

        def _read_files_and_tokenize(self):
            pass

    return RowsDataset([], tokenizer, cfg.data, processor=None, max_samples=-1)


class _FilterInThisProcess:
    """The `datasets.Dataset` verl's `maybe_filter_out_long_prompts` calls `.filter(predicate)`
    on, with the predicate (verl's own prompt-length rule) applied row by row in this process.
    `datasets.Dataset.filter` would first hash the predicate, which holds the tokenizer, to
    fingerprint the step (~1.2 s per shard), and run it in a worker process."""

    def __init__(self, rows: datasets.Dataset):
        self.rows = rows

    def filter(self, predicate, num_proc=None, desc=None) -> datasets.Dataset:
        kept = [position for position, row in enumerate(self.rows) if predicate(row)]
        if len(kept) == len(self.rows):
            return self.rows
        return datasets.Dataset(datasets.table.InMemoryTable(self.rows.data.table.take(kept)))


class ShardPrompts:
    """The prompts of dataset rows [start, end) that survive verl's overlong filter, in dataset
    order, as the keyword arguments verl's agent loops take.

    The rows are held as Arrow (a `datasets.Dataset` over the shard's table) and become Python
    one row at a time, when an agent loop needs them. The overlong filter is verl's own
    `RLHFDataset.maybe_filter_out_long_prompts` on the shard's rows, run once here: the shard job
    needs its kept rows (their sample ids) before it dispatches anything."""

    def __init__(self, cfg: DictConfig, dataset: DatasetFiles, start: int, end: int, tokenizer):
        table = read_rows(dataset, start, end, data_storage_options(cfg))
        self.tokenizer = tokenizer
        self.rows_digest = rows_digest(table)
        """sha256 of the shard's raw rows (before filtering): a resume over changed rows is refused with it."""
        self._dataset = _rlhf_dataset(cfg, tokenizer)
        rows = datasets.Dataset(datasets.table.InMemoryTable(table))
        self._dataset.dataframe = self._dataset.maybe_filter_out_long_prompts(_FilterInThisProcess(rows))
        self.filtered_overlong = table.num_rows - len(self._dataset)
        """Rows of the shard dropped as longer than data.max_prompt_length: never generated."""
        if self.filtered_overlong:
            logger.warning(
                "rows [%d, %d): dropped %d of %d prompts longer than data.max_prompt_length=%d tokens; raise it to keep them",
                start, end, self.filtered_overlong, table.num_rows, cfg.data.max_prompt_length,
            )
        self.default_agent_loop = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        kept = self._dataset.dataframe
        self._indices = pc.struct_field(kept.select_columns(["extra_info"]).with_format("arrow")[:].column("extra_info"), "index").to_numpy()
        self._names = (
            pc.unique(kept.select_columns(["agent_name"]).with_format("arrow")[:].column("agent_name")).to_pylist()
            if "agent_name" in kept.column_names else [None]
        )

    @classmethod
    def for_shard(cls, cfg: DictConfig, dataset: DatasetFiles, shard: ShardSpec, tokenizer) -> ShardPrompts:
        return cls(cfg, dataset, shard.start, shard.end, tokenizer)

    def __len__(self) -> int:
        return len(self._dataset)

    def agent_names(self) -> set[str]:
        """Every agent loop the kept rows ask for (per-row `agent_name`, else the default)."""
        return {name or self.default_agent_loop for name in self._names}

    def sample_index(self, position: int) -> int:
        """The kept row's `extra_info.index` (its sample id), without building the row."""
        return int(self._indices[position])

    def agent_kwargs(self, position: int) -> dict[str, Any]:
        """The kept row's non-tensor fields, as verl's generate_sequences passes them to an agent loop."""
        row = self._dataset[position]
        kwargs = {k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}
        # A null agent_name (a file where only some rows name one) means the default, as in
        # agent_names(); verl's registry has no loop named None.
        if kwargs.get("agent_name") is None:
            kwargs["agent_name"] = self.default_agent_loop
        return kwargs


def check_overlong_sample(cfg: DictConfig, dataset: DatasetFiles, tokenizer) -> None:
    """Refuse a run whose prompts are all too long, from the first OVERLONG_SAMPLE_ROWS rows
    (preflight does not tokenize the dataset; each shard filters its own rows exactly)."""
    if not cfg.data.filter_overlong_prompts:
        return
    sample = ShardPrompts(cfg, dataset, 0, min(OVERLONG_SAMPLE_ROWS, dataset.num_rows), tokenizer)
    if len(sample) == 0:
        raise GenrunError(
            f"no prompt left after filtering: all {sample.filtered_overlong} sampled prompts (the dataset's first rows) are longer "
            f"than data.max_prompt_length={cfg.data.max_prompt_length} tokens; raise it or turn off data.filter_overlong_prompts"
        )

