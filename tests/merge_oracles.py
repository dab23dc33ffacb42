"""Test oracles for the merge: the same padding built from in-memory records, the committed
records read back whole, the chunked output loaded as one DataProto. Small runs only (everything
in memory); the library's merge streams parts and never holds a run's records."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pyarrow as pa
from verl.protocol import DataProto

from generation_core.errors import GenrunError
from generation_core.outputs.merge import _DEFAULT_EXTRA_KEYS
from generation_core.outputs.padding import BatchLayout, PaddedBatchBuilder
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.run_folder import CHUNK_INDEX_FILE
from generation_core.store.trajectory_record import PART_SCHEMA, TOKEN_COLUMNS, TrajectoryRecord, records_from_parquet


def layout_of_records(records: list[TrajectoryRecord]) -> BatchLayout:
    """The batch layout verl's _postprocess would choose for `records` (in this order)."""
    reward_infos = [r.extra_fields.get("reward_extra_info") or {} for r in records]
    return BatchLayout(
        with_logprobs=records[0].response_logprobs is not None,
        with_rm_scores=all(r.reward_score is not None for r in records),
        input_keys=list(records[0].input_fields),
        reward_extra_keys=list(dict.fromkeys(key for info in reward_infos for key in info)),
        complete_reward_keys=set.intersection(*(set(info) for info in reward_infos)),
        extra_keys=sorted({key for r in records for key in r.extra_fields} | _DEFAULT_EXTRA_KEYS),
    )


def build_dataproto(
    records: list[TrajectoryRecord], *, prompt_length: int, response_length: int, pad_token_id: int
) -> DataProto:
    """Pad and batch `records` (in the given order) the way verl's agent loop does."""
    if not records:
        raise GenrunError("nothing to merge: no trajectory was committed")
    builder = PaddedBatchBuilder(
        len(records),
        layout_of_records(records),
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=pad_token_id,
    )
    tokens = pa.table(
        {name: [getattr(r, name) for r in records] for name in TOKEN_COLUMNS},
        schema=pa.schema([PART_SCHEMA.field(name) for name in TOKEN_COLUMNS]),
    )
    builder.add(
        tokens,
        np.arange(len(records)),
        [r.input_fields for r in records],
        [r.extra_fields for r in records],
        [r.metrics for r in records],
    )
    return builder.finish()


def read_committed_records(folder: StorageFolder) -> list[TrajectoryRecord]:
    """Every committed trajectory of every shard, checksums verified, sorted by (index, rollout_n)."""
    records: list[TrajectoryRecord] = []
    for part in committed_parts(folder):
        records.extend(records_from_parquet(read_verified_part(folder, part)))
    records.sort(key=lambda r: r.key)
    keys = [r.key for r in records]
    if len(set(keys)) != len(keys):
        raise GenrunError(f"{folder.display()} holds duplicate trajectories; run `genrun status` on it")
    return records


def load_chunks(folder: StorageFolder) -> DataProto:
    """The chunked output read back as one DataProto (checksums verified)."""
    index = folder.read_json(CHUNK_INDEX_FILE)
    parts = []
    for chunk in index["chunks"]:
        data = folder.read_bytes(chunk["name"])
        if hashlib.sha256(data).hexdigest() != chunk["sha256"]:
            raise GenrunError(f"{folder.display(chunk['name'])} does not match the checksum in {CHUNK_INDEX_FILE}")
        parts.append(pickle.loads(data))
    return DataProto.concat(parts)
