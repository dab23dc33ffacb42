"""Prompts: check the dataset files cheaply, load them with verl's RLHFDataset, plan shards.

The checks run before any model loads and read only what they must (Parquet schema, the
`extra_info` column), so a wrong file is refused in a second with a message that names it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig

from generation_core.config import train_files
from generation_core.errors import GenrunError
from generation_core.run_folder import shard_name

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".parquet", ".json", ".jsonl")


@dataclass(frozen=True)
class ShardSpec:
    """A fixed range of dataset positions [start, end) and its stable name."""

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
    def from_dict(cls, payload: dict[str, int]) -> "ShardSpec":
        return cls(int(payload["shard_id"]), int(payload["start"]), int(payload["end"]))


_HOW_TO_WRITE = "data.train_files takes Parquet (or JSON/JSONL) files in verl's chat layout, e.g. written by pandas' DataFrame.to_parquet"


def _read_table(path: str) -> pa.Table:
    if not path.endswith(SUPPORTED_SUFFIXES):
        raise GenrunError(f"data file {path}: unsupported format; use {', '.join(SUPPORTED_SUFFIXES)} ({_HOW_TO_WRITE})")
    try:
        with fsspec.open(path, "rb") as handle:
            if path.endswith(".parquet"):
                return pq.read_table(handle)
            return pa_json.read_json(handle)
    except FileNotFoundError:
        raise GenrunError(f"data file {path} does not exist; set data.train_files to an existing parquet file") from None
    except IsADirectoryError:
        raise GenrunError(f"data file {path} is a directory, not a file; list the files in it in data.train_files, e.g. data.train_files=[{path}/part-0.parquet]") from None
    except PermissionError:
        raise GenrunError(f"data file {path} is not readable (permission denied); make it readable by this user or copy it to a readable place") from None
    except (pa.ArrowInvalid, OSError) as exc:
        kind = path.rsplit(".", 1)[-1]
        raise GenrunError(f"data file {path} cannot be read as {kind} ({str(exc).splitlines()[0]}); {_HOW_TO_WRITE}") from None


def _check_chat_column(path: str, table: pa.Table, prompt_key: str) -> None:
    if prompt_key not in table.column_names:
        raise GenrunError(
            f"data file {path} has no column {prompt_key!r} (columns: {', '.join(table.column_names)}); "
            "set data.prompt_key to the column holding the chat messages"
        )
    kind = table.schema.field(prompt_key).type
    is_chat = (
        pa.types.is_list(kind) or pa.types.is_large_list(kind)
    ) and pa.types.is_struct(kind.value_type) and {"role", "content"} <= {f.name for f in kind.value_type}
    if not is_chat:
        raise GenrunError(
            f"data file {path}: column {prompt_key!r} is {kind}, not a list of chat messages; "
            "each prompt must look like [{'role': 'user', 'content': '...'}]"
        )


def _check_indices(path: str, table: pa.Table, seen: dict[int, str]) -> None:
    if "extra_info" not in table.column_names:
        raise GenrunError(
            f"data file {path} has no extra_info column; every row needs extra_info.index "
            "(a unique integer id per prompt, as verl's preprocessing scripts write it)"
        )
    for row_number, info in enumerate(table.column("extra_info").to_pylist()):
        index = info.get("index") if isinstance(info, dict) else None
        if index is None or isinstance(index, bool) or not isinstance(index, int):
            raise GenrunError(
                f"data file {path} row {row_number}: extra_info.index is missing or not an integer; "
                "every row needs a unique integer extra_info.index (the sample id used for resume)"
            )
        if index in seen:
            raise GenrunError(f"data file {path} row {row_number}: extra_info.index {index} repeats (also in {seen[index]}); ids must be unique")
        seen[index] = path


def check_prompt_files(cfg: DictConfig) -> str:
    """Validate every data file and return a content hash of all of them."""
    digest = hashlib.sha256()
    seen: dict[int, str] = {}
    total_rows = 0
    for path in train_files(cfg):
        path = os.path.expanduser(path)
        table = _read_table(path)
        _check_chat_column(path, table, cfg.data.prompt_key)
        _check_indices(path, table, seen)
        total_rows += table.num_rows
        with fsspec.open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    if total_rows == 0:
        raise GenrunError(f"the dataset is empty ({', '.join(train_files(cfg))} hold no rows)")
    return digest.hexdigest()


class PromptSet:
    """The prompts of a run, in dataset order, as the keyword arguments verl's agent loops take."""

    def __init__(self, cfg: DictConfig, tokenizer):
        from verl.utils.dataset.rl_dataset import RLHFDataset

        files = [os.path.expanduser(p) for p in train_files(cfg)]
        before = _count_rows(files, cfg.data.train_max_samples)
        self.dataset = RLHFDataset(files, tokenizer, cfg.data, processor=None, max_samples=cfg.data.train_max_samples)
        self.filtered_overlong = before - len(self.dataset)
        if len(self.dataset) == 0:
            raise GenrunError(
                f"no prompt left after filtering: all {before} are longer than data.max_prompt_length="
                f"{cfg.data.max_prompt_length} tokens; raise it or turn off data.filter_overlong_prompts"
            )
        if self.filtered_overlong:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens; raise it to keep them",
                self.filtered_overlong, before, cfg.data.max_prompt_length,
            )
        self.default_agent_loop = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        self._indices: list[int] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def agent_names(self) -> set[str]:
        """Every agent loop the prompts ask for (per-row `agent_name`, else the default)."""
        dataframe = self.dataset.dataframe
        if "agent_name" not in dataframe.column_names:
            return {self.default_agent_loop}
        return {name or self.default_agent_loop for name in dataframe.unique("agent_name")}

    def sample_index(self, position: int) -> int:
        """The row's `extra_info.index` (its sample id), without building the whole row."""
        if self._indices is None:
            self._indices = [int(info["index"]) for info in self.dataset.dataframe["extra_info"]]
        return self._indices[position]

    def agent_kwargs(self, position: int) -> dict[str, Any]:
        """The row's non-tensor fields, as verl's generate_sequences passes them to an agent loop."""
        row = self.dataset[position]
        kwargs = {k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}
        kwargs.setdefault("agent_name", self.default_agent_loop)
        return kwargs


def _count_rows(files: list[str], max_samples: int) -> int:
    total = 0
    for path in files:
        with fsspec.open(path, "rb") as handle:
            total += pq.ParquetFile(handle).metadata.num_rows if path.endswith(".parquet") else _read_table(path).num_rows
    return min(total, max_samples) if max_samples and max_samples > 0 else total


def plan_shards(num_rows: int, num_shards: int) -> list[ShardSpec]:
    """Split positions 0..num_rows into `num_shards` contiguous, nearly equal ranges."""
    if num_shards > num_rows:
        raise GenrunError(f"generation.num_shards={num_shards} is more than the {num_rows} prompts; use at most {num_rows}")
    base, extra = divmod(num_rows, num_shards)
    shards, start = [], 0
    for shard_id in range(num_shards):
        end = start + base + (1 if shard_id < extra else 0)
        shards.append(ShardSpec(shard_id, start, end))
        start = end
    return shards
